"""Parameter shapes of three reference models, for benchmarks that need realistic gradient layouts
without building the models (no torchvision or transformers needed).

- ``resnet50_shapes()``: torchvision's ``resnet50()``, 161 tensors, 25,557,032 values.
- ``bert_base_shapes()``: Hugging Face ``BertModel`` for ``bert-base-uncased`` (embeddings,
  12 encoder layers, pooler; no pre-training heads), 199 tensors, 109,482,240 values.
- ``gpt2_small_shapes()``: Hugging Face ``GPT2LMHeadModel`` for ``gpt2`` (124M; the head tied to
  the token embedding, so not a tensor of its own), 148 tensors, 124,439,808 values.

All in ``named_parameters()`` order: the order a backward pass reaches them is roughly the reverse.
"""

import math

RESNET50 = {"tensors": 161, "numel": 25_557_032}
BERT_BASE = {"tensors": 199, "numel": 109_482_240}
GPT2_SMALL = {"tensors": 148, "numel": 124_439_808}


def resnet50_shapes():
    """The 161 parameter shapes of torchvision's resnet50(), in named_parameters() order."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def bert_base_named_shapes(vocab=30522, hidden=768, layers=12, intermediate=3072, positions=512,
                           token_types=2):
    """``[(name, shape)]`` of Hugging Face's BertModel (bert-base-uncased by default), in
    named_parameters() order; Linear weights are (out_features, in_features)."""
    h = hidden
    out = [("embeddings.word_embeddings.weight", (vocab, h)),
           ("embeddings.position_embeddings.weight", (positions, h)),
           ("embeddings.token_type_embeddings.weight", (token_types, h)),
           ("embeddings.LayerNorm.weight", (h,)), ("embeddings.LayerNorm.bias", (h,))]
    for i in range(layers):
        pre = f"encoder.layer.{i}."
        for part in ("query", "key", "value"):
            out += [(f"{pre}attention.self.{part}.weight", (h, h)), (f"{pre}attention.self.{part}.bias", (h,))]
        out += [(f"{pre}attention.output.dense.weight", (h, h)), (f"{pre}attention.output.dense.bias", (h,)),
                (f"{pre}attention.output.LayerNorm.weight", (h,)), (f"{pre}attention.output.LayerNorm.bias", (h,)),
                (f"{pre}intermediate.dense.weight", (intermediate, h)), (f"{pre}intermediate.dense.bias", (intermediate,)),
                (f"{pre}output.dense.weight", (h, intermediate)), (f"{pre}output.dense.bias", (h,)),
                (f"{pre}output.LayerNorm.weight", (h,)), (f"{pre}output.LayerNorm.bias", (h,))]
    out += [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]
    return out


def bert_base_shapes():
    """The 199 parameter shapes of bert-base-uncased's BertModel, in named_parameters() order."""
    return [shape for _, shape in bert_base_named_shapes()]


def gpt2_small_named_shapes(vocab=50257, positions=1024, width=768, layers=12):
    """``[(name, shape)]`` of Hugging Face's GPT2LMHeadModel (``gpt2`` by default), in
    named_parameters() order; its Conv1D weights are (in_features, out_features)."""
    w = width
    out = [("transformer.wte.weight", (vocab, w)), ("transformer.wpe.weight", (positions, w))]
    for i in range(layers):
        pre = f"transformer.h.{i}."
        out += [(f"{pre}ln_1.weight", (w,)), (f"{pre}ln_1.bias", (w,)),
                (f"{pre}attn.c_attn.weight", (w, 3 * w)), (f"{pre}attn.c_attn.bias", (3 * w,)),
                (f"{pre}attn.c_proj.weight", (w, w)), (f"{pre}attn.c_proj.bias", (w,)),
                (f"{pre}ln_2.weight", (w,)), (f"{pre}ln_2.bias", (w,)),
                (f"{pre}mlp.c_fc.weight", (w, 4 * w)), (f"{pre}mlp.c_fc.bias", (4 * w,)),
                (f"{pre}mlp.c_proj.weight", (4 * w, w)), (f"{pre}mlp.c_proj.bias", (w,))]
    out += [("transformer.ln_f.weight", (w,)), ("transformer.ln_f.bias", (w,))]
    return out


def gpt2_small_shapes():
    """The 148 parameter shapes of GPT-2 small (124M), in named_parameters() order."""
    return [shape for _, shape in gpt2_small_named_shapes()]


MODELS = {"resnet50": resnet50_shapes, "bert-base": bert_base_shapes, "gpt2-small": gpt2_small_shapes}


def model_shapes(name):
    """Shapes of ``"resnet50"``, ``"bert-base"`` or ``"gpt2-small"``."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def numel(shapes):
    return sum(math.prod(s) for s in shapes)

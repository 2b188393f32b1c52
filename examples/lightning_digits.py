#!/usr/bin/env python
"""The digits example with Lightning: ``DDPStrategy`` with hvd_topk's DDP communication hook.

    pip install ".[lightning]"
    python examples/lightning_digits.py --devices 2            # Lightning starts the 2 processes
    torchrun --nproc_per_node 2 examples/lightning_digits.py   # or torchrun does

The two lines that matter are the ``TopKState`` and the ``DDPStrategy`` in ``main``: Top-K at
``--density`` with error feedback, the pairs allgathered between the ranks (gloo on CPU). On CPU
Lightning ignores ``ddp_comm_hook`` (it registers hooks on CUDA only), so ``RegisterHookOnCpu``
registers it there.
Rank 0 prints the test accuracy and the bytes sent against a dense fp32 allreduce; its last
line is ``test accuracy: X.XXXX``.
"""

import argparse
import json
import os
from pathlib import Path

import lightning
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

from cli import HelpFormatter, check_interval, usage_error_from, output_path  # shared by the examples
import hvd_topk.ddp
from hvd_topk.checks import check_density
from digits_model import DigitsNet, load_digits_split


class Digits(lightning.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.net, self.lr = DigitsNet(), lr

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class RegisterHookOnCpu(lightning.Callback):
    """Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only on CUDA devices and ignores
    it silently on CPU (``DDPStrategy._register_ddp_hooks``, lightning 2.6.6, a limit of torch
    1.8 that no longer holds); on CPU this registers it once DDP has wrapped the model."""

    def __init__(self, state):
        self.state = state

    def on_fit_start(self, trainer, module):
        if trainer.strategy.root_device.type == "cpu":
            hvd_topk.ddp.register(trainer.strategy.model, self.state)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", 2)),
                   help="processes (Lightning starts them; under torchrun, its world size)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", type=output_path,
                   help="write the final metrics here (rank 0)")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.devices < 1:
        p.error("--epochs, --batch-size and --devices must be positive integers")
    check_interval(p, "--lr", args.lr, 0, low_open=True)
    usage_error_from(p, check_density, args.density, "--density")
    lightning.seed_everything(args.seed, verbose=False)
    torch.set_num_threads(1)
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    module = Digits(args.lr)
    state = hvd_topk.ddp.TopKState(density=args.density, exchange="allgather",
                                   named_parameters=module.named_parameters())
    trainer = lightning.Trainer(
        accelerator="cpu", devices=args.devices, max_epochs=args.epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RegisterHookOnCpu(state)],
        strategy=DDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                             ddp_comm_hook=hvd_topk.ddp.topk_hook))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train),
                                         batch_size=args.batch_size, shuffle=True)
    trainer.fit(module, loader)  # Lightning's DistributedSampler gives each rank its own part
    if trainer.global_rank == 0:
        with torch.no_grad():
            accuracy = (module.net(x_test).argmax(1) == y_test).float().mean().item()
        stats = state.stats()
        ratio = "0 (one rank: nothing is exchanged)" if trainer.world_size == 1 else f"{stats['bytes_ratio']:.2%}"
        print(f"bytes sent vs dense fp32: {ratio} over {stats['steps']} steps ({trainer.world_size} ranks)")
        if args.json:
            Path(args.json).write_text(json.dumps({"test_accuracy": accuracy, "ranks": trainer.world_size,
                                                   "topk_stats": stats}, indent=1, default=str))
        print(f"test accuracy: {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()

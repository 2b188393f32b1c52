"""``raises``: pytest.raises for the distributed check scripts (which run without pytest)."""

import contextlib
import re


@contextlib.contextmanager
def raises(expected, match=None, what=None):
    """Like ``pytest.raises``: the block must raise ``expected`` (a type or a tuple of types).

    ``match`` is a regular expression searched in ``str(exception)`` (``re.escape`` a literal
    text); ``what`` prefixes the failure message. Any other exception propagates unchanged. The
    context value's ``.value`` is the exception caught.
    """
    caught = _Caught()
    prefix = f"{what}: " if what else ""
    try:
        yield caught
    except expected as exc:
        caught.value = exc
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{prefix}{type(exc).__name__} raised, but its message {str(exc)!r} "
                                 f"does not match {match!r}") from exc
    else:
        raise AssertionError(f"{prefix}did not raise {_type_names(expected)}")


class _Caught:
    value = None


def _type_names(expected):
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(t.__name__ for t in types)

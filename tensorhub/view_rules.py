"""The names of views that the hub and the SDK share (torch-free: the hub checks them without
importing torch; the formats themselves are `ros.views`, docs/views.md).

A view of `model@v` in format `fmt` is the version v of the model `{model}.{fmt}`
(`policy.fp8-block128@7`): a model name of its own, so that everything keyed by a model
(holders, leases, failover, pins, read tokens, `ls`, `inspect`, `holders`, watches,
quotas) applies to it unchanged. Names ending in `.{fmt}` for a format below are reserved:
only a publish of `model@v` with that view creates their versions.
"""

from __future__ import annotations

import contextlib

from tensorhub.delta_rules import companion_of, is_companion
from tensorhub.errors import InvalidArgument, InvalidName
from tensorhub.names import validate_name

FORMATS = ("fp8-block128", "mxfp8")  # the view formats (`ros.views.FORMATS`, same names)
MAX_VIEWS = len(FORMATS)  # the views one publish may ask for: each format once


def check_format(fmt: object) -> str:
    """`fmt` if it names a view format, else `InvalidArgument` naming the formats."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise InvalidArgument(f"view {fmt!r}: not a view format (one of {', '.join(FORMATS)})")
    return fmt


def view_model(model: str, fmt: str) -> str:
    """The model whose version v is the `fmt` view of `model@v`; `InvalidArgument` for an
    unknown format, `InvalidName` when the name would pass the name pattern's length or
    `model` is itself a view."""
    check_format(fmt)
    if is_view(model):
        raise InvalidName(f"model {model!r} is a view: a view has no views of its own")
    return validate_name(f"{model}.{fmt}", f"view model of {model!r}")


def view_of(name: str) -> tuple[str, str] | None:
    """(model, format) when `name` is a view's model name, else None."""
    for fmt in FORMATS:
        suffix = "." + fmt
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], fmt
    return None


def is_view(name: str) -> bool:
    """Whether `name` is reserved for views (ends in `.{format}`)."""
    return view_of(name) is not None


def check_views(model: str, formats: object) -> list[str]:
    """The formats of a publish's `views=` (each once, each known), in order; the errors
    of `check_format`, and `InvalidArgument` for a repeat or a bare string."""
    if isinstance(formats, str) or not isinstance(formats, list | tuple):
        raise InvalidArgument(f"views {formats!r}: a sequence of formats, e.g. ('{FORMATS[0]}',)")
    seen: list[str] = []
    for fmt in formats:
        view_model(model, check_format(fmt))
        if fmt in seen:
            raise InvalidArgument(f"view {fmt!r} asked for twice")
        seen.append(fmt)
    return seen


def views_of(model: str) -> list[str]:
    """Every model a publish of `model` with views can create: each format's view model and
    that view's delta companion (`{model}.{fmt}.delta`), those whose name is valid. Deleting
    `model` deletes them with it, and its retention collects them with its versions; none
    when `model` is itself a view or a delta companion (neither has views)."""
    if is_view(model) or is_companion(model):
        return []
    found: list[str] = []
    for fmt in FORMATS:
        for name in (f"{model}.{fmt}", companion_of(f"{model}.{fmt}")):
            with contextlib.suppress(InvalidName):  # not a name (too long): never published
                found.append(validate_name(name))
    return found

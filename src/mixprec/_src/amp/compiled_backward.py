"""A compiled backward computes in the precision its forward chose, as eager's does.

Eager autograd runs a backward outside autocast (``loss.backward()`` after the region closed): a
module kept in fp32 gets fp32 gradients. torch 2.13 traces a compiled backward under the autocast
state around the compiled call instead (``torch._functorch.config.backward_pass_autocast =
"same_as_forward"``, its default; pytorch#153044): a compiled model called inside an fp16 region
would compute its kept modules' gradients in fp16, overflowing where eager is finite.

Every place where mixprec chooses a precision inside traced code (a region's entry, a kept
module, a module rule, a layer's own dtype) calls :func:`backward_like_eager` while Dynamo
traces it. For the rest of that compile (Dynamo's trace and the backend's, where AOTAutograd
traces the backward) torch's setting reads ``"off"``, eager's behaviour; when the compile ends
(an end-of-compile callback registered with Dynamo) the setting is restored. A setting the user chose (anything
but torch's default) is left alone, and compiles that trace no mixprec code are untouched.

Nothing here syncs with the device; it runs at compile time only.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch._functorch.config as functorch_config

from mixprec._src.amp.dispatch import never_a_frame

__all__ = ["backward_like_eager", "restore"]

_TORCH_DEFAULT = "same_as_forward"
_lock = threading.Lock()
_saved: list[Any] = []  # the setting to restore when the compile in progress ends


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def backward_like_eager() -> bool:
    """While compiling: trace this compile's backward outside autocast, as eager runs it.

    Dynamo runs this once, at trace time (its result is a constant of the graph); eagerly it
    does nothing. Returns whether the setting is (now) eager's.
    """
    if not torch.compiler.is_compiling():
        return False
    if torch._guards.CompileContext.current_compile_id() is None:  # not Dynamo's compile (an export): no
        return False  # end-of-compile callback would restore the setting, and an export has no backward
    with _lock:
        if not _saved and functorch_config.backward_pass_autocast == _TORCH_DEFAULT:
            handler = torch._dynamo.callback.callback_handler
            if restore not in handler.end_callbacks:  # torch._dynamo.reset() clears the callbacks
                handler.register_end_callback(restore)
            _saved.append(functorch_config.backward_pass_autocast)
            functorch_config.backward_pass_autocast = "off"
    return functorch_config.backward_pass_autocast == "off"


def restore(*_: Any) -> None:
    """Put torch's setting back as it was before the compile (Dynamo calls this when a compile ends)."""
    with _lock:
        if _saved:
            functorch_config.backward_pass_autocast = _saved.pop()


# Dynamo runs its end-of-compile callbacks from inside compiled code too (a backward compiled when it
# first runs, within a compiled training step): the callback must never become a frame it compiles.
never_a_frame(restore)

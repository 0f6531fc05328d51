"""O2's low-precision copies: the forward of each module computes with copies of its fp32 master weights.

:class:`ComputeCopies` holds one low-precision copy per parameter, refreshed together after each
optimizer step (one multi-tensor copy, at the first eager forward after it: a compiled forward casts in
its graph and never reads them) and one by one when a parameter was written since (its version
counter, read on the host: no sync). :func:`install_copies` puts a module's copies in place
around its call (:class:`SwapCall`), as FSDP2 puts gathered parameters; their gradients flow into the
fp32 masters, widened, through an alias of each master made once and kept until the master is written or stored
anew (:attr:`ComputeCopies.aliases`: no op a weight a forward). Compiled, the forward casts the master in the graph
instead.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

__all__ = ["ComputeCopies", "SwapCall", "enter_whole", "install_copies", "leave_whole", "swapped_whole"]


class ComputeCopies:
    """O2's low-precision copies of fp32 parameters, made once per change of the parameter.

    Refreshed together after each optimizer step (one multi-tensor copy, made when the first copy is
    asked for after :meth:`stale` was called: a compiled forward never asks) but for those the step wrote
    itself (:meth:`wrote`: the optimizer's own step on the CPU writes a master's copy with it where an eager forward
    read the copies since the last step, :attr:`read`), and, one by one,
    whenever a parameter's version counter moved since (``load_state_dict``, ``nn.init``, in-place writes under
    ``no_grad``) or its data was stored anew (``p.data = t``: the version stays, the address moves). Checking a
    version or an address is host-side: no sync.
    """

    def __init__(self, dtype: torch.dtype, params: list[nn.Parameter]) -> None:
        self.dtype = dtype
        self.params = params
        self.copies: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}
        self.addresses: dict[int, int] = {}  # id -> the address of the parameter's data when its copy was made
        self.behind = False  # an optimizer step wrote the parameters since the last refresh
        # while behind: id -> version at the write, of the parameters every step since wrote the copies of
        self.current: dict[int, int] = {}
        self.written: dict[int, int] = {}  # the same, of the step under way (until stale() is called)
        self.read = True  # an eager forward used the copies since the last step (a compiled one casts its own)
        # id -> (the inner alias of _from_copy, the copy it holds, its master's version when it was made): an
        # alias has no saved tensor, so its backward node serves every forward until its master is written (a
        # write moves the version the alias shares with it: autograd would remake its node as a strided copy)
        self.aliases: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.calls: list[SwapCall] = []  # torch layers' calls, put in place together around the model's (WholeSwap)
        self.lifted: list[SwapCall] | None = None  # those lifted for the model's call under way
        self.refresh()

    def wrote(self, params: list[torch.Tensor]) -> None:
        """The step under way wrote the copies of ``params`` with them (a write after it moves their versions)."""
        self.written.update((id(p), p._version) for p in params)

    def use(self) -> None:
        """An eager forward reads the copies: those a step left behind are refreshed first."""
        self.read = True
        if self.behind:
            self.refresh()

    def stale(self) -> None:
        """The copies are behind their parameters (an optimizer step), but those the step wrote itself (and every
        step before it since the last refresh): refreshed together at the next use."""
        written, current = self.written, self.current
        self.current = written if not self.behind else {k: v for k, v in written.items() if k in current}
        self.written = {}
        self.behind, self.read = True, False

    def refresh(self) -> None:
        """Copy every parameter (after a step: every one the steps did not write the copy of) into its
        low-precision copy."""
        current = self.current if self.behind else {}
        self.behind, self.current = False, {}
        if current and current.keys() == self.versions.keys():  # the steps wrote every copy: each as then
            self.versions = current
            return
        versions = {id(p): p._version for p in self.params}
        with torch.no_grad():
            behind = []
            for p in self.params:
                held = self.copies.get(id(p))
                if held is None or held.shape != p.shape or held.device != p.device:
                    self.copies[id(p)] = torch.empty_like(p, dtype=self.dtype, memory_format=torch.preserve_format)
                elif id(p) in current:  # as its parameter was when the step wrote it: of() sees a write since
                    versions[id(p)] = current[id(p)]
                    continue
                behind.append(p)
            if behind:  # one multi-tensor copy (no detach a parameter: under no_grad they are not recorded)
                torch._foreach_copy_([self.copies[id(p)] for p in behind], list[torch.Tensor](behind))
        self.versions = versions
        self.addresses.update((id(p), address(p)) for p in behind)  # a written one's: as at its last copy

    def of(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s copy, made again if the parameter was written or stored anew since (after :meth:`refresh`)."""
        held, key = self.copies[id(param)], id(param)
        if (
            param._version != self.versions[key]
            or address(param) != self.addresses.get(key)
            or held.device != param.device
            or held.shape != param.shape
        ):
            with torch.no_grad():
                if held.device != param.device or held.shape != param.shape:
                    held = self.copies[id(param)] = torch.empty_like(
                        param, dtype=self.dtype, memory_format=torch.preserve_format
                    )
                held.copy_(param)
            self.versions[key], self.addresses[key] = param._version, address(param)
        return held

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies.values())

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save(model)``) with each copy beside its parameter: the dicts are keyed by ``id``."""
        if self.behind:  # the loaded copies are taken as current
            self.refresh()
        copies = [self.copies.get(id(p)) for p in self.params]
        return {"dtype": self.dtype, "params": self.params, "copies": copies, "calls": self.calls}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dtype, self.params, self.behind = state["dtype"], state["params"], False
        self.current, self.written, self.read, self.aliases = {}, {}, True, {}
        self.calls, self.lifted = state.get("calls", []), None
        self.copies = {id(p): c for p, c in zip(self.params, state["copies"], strict=True) if c is not None}
        self.versions = {id(p): p._version for p in self.params if id(p) in self.copies}
        self.addresses = {id(p): address(p) for p in self.params if id(p) in self.copies}


def address(param: torch.Tensor) -> int:
    """Where ``param``'s data is (0 for a tensor subclass, whose data is its own): a new address is new data."""
    return param.data_ptr() if type(param) is nn.Parameter or type(param) is torch.Tensor else 0


class _FromCopy(torch.autograd.Function):
    """The low-precision copy as the forward's weight; its gradient goes to the fp32 parameter, widened.

    The route for tensor subclasses (a ``DTensor`` master): a Python call a parameter in the forward and in
    the backward. Written with ``forward(ctx, ...)``, not ``setup_context``: with ``setup_context`` every
    ``apply`` binds its arguments through ``inspect.signature``."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, held: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.master_dtype = master.dtype
        return held.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.to(ctx.master_dtype), None


def _from_copy(master: torch.Tensor, held: torch.Tensor, sparse: bool = False) -> torch.Tensor:
    """``held``'s values with ``master``'s autograd history.

    An alias of an alias of the master (``master[...]``) whose data is the copy: their backwards pass the gradient
    on (C++, no Python call, no op).
    The outer one sums the gradients of the weight's uses in the copy's dtype (as :class:`_FromCopy` and a
    cached autocast cast do); autograd's engine casts that sum to the master's dtype on its way into the
    inner one, recorded before its data was swapped, and the master's own accumulator takes it, so the
    master's hooks (DDP's reducer, a step in backward) fire as for any parameter. A torch layer's forward, which
    uses each weight once (nothing to sum), gets the inner alias alone (:class:`_Swap`): one node fewer, the same bits.
    The alias (a view) shares the master's version counter: a step or a write into the master between this forward
    and its backward is reported by autograd, as it would be for the master itself. Three C++ calls, no
    kernel. Where the gradient is sparse (``nn.Embedding(sparse=True)``) or the
    master a tensor subclass, the copy goes through :class:`_FromCopy`.
    """
    if sparse or (type(master) is not nn.Parameter and type(master) is not torch.Tensor):
        return cast(torch.Tensor, _FromCopy.apply(master, held))  # type: ignore[no-untyped-call]
    widen = master[...]  # its backward's input was recorded in the master's dtype: the engine widens
    widen.data = held
    return widen[...]  # recorded in the copy's dtype: the uses' gradients are summed in it, as before


#: torch's layers whose forward (the class's own) uses each parameter once: their copies need no outer alias
_USED_ONCE = frozenset(
    {
        nn.Linear,
        nn.modules.linear.NonDynamicallyQuantizableLinear,
        nn.Bilinear,
        nn.MultiheadAttention,  # its projections' weights and biases: one linear each (split or chunked: one node)
        nn.Embedding,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
    }
)


#: one weight a torch layer's swap keeps: (name, master, its version, its data's address, requires_grad, what was put)
_Entry = tuple[str, torch.Tensor, int, int, bool, torch.Tensor]


class _Swap:
    """Puts one module's parameters' copies in place around its forward, as FSDP2 puts gathered ones.

    What a torch layer's forward with gradients was given is kept (:attr:`kept`) and put in place again, one dict
    update, while each master is still the module's, its version counter, the address of its data (a copy is
    stored anew only for new data) and ``requires_grad`` are as they were, and no hook was put on what the forward
    saw: a few attribute reads a weight a call. torch's ``nn.MultiheadAttention`` reads its ``out_proj``'s weight and
    bias without calling it: its call puts them in place too (:attr:`inner`), where autocast would cast them, to the
    same values.
    """

    def __init__(self, module: nn.Module, names: list[str], copies: ComputeCopies) -> None:
        self.masters = {n: module._parameters[n] for n in names}
        self.pairs = tuple(self.masters.items())
        self.copies = copies
        self.depth = 0  # a module may call itself inside its own forward: swap once
        self.rnn = isinstance(module, nn.RNNBase)  # RNNs read weights from a list made when they are set
        self.sparse = bool(getattr(module, "sparse", False))  # nn.Embedding(sparse=True), EmbeddingBag
        self.torch_layer = type(module) in _USED_ONCE  # with its class's forward, each weight is used once
        self.kept: tuple[tuple[_Entry, ...], dict[str, torch.Tensor]] | None = None  # (entries, what they put)
        self.inner: tuple[nn.Module, _Swap] | None = None  # an attention's out_proj and its swap
        self.inside = False  # this call entered inner's swap

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied without what was kept (views with autograd history): made again at the next call."""
        return {**self.__dict__, "kept": None, "inside": False}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A pickle of an older version (its hooks call :meth:`enter` and :meth:`leave`) has no ``pairs``."""
        self.__dict__.update(state)
        self.pairs = tuple(self.masters.items())
        self.torch_layer = state.get("torch_layer", False)
        self.kept, self.inner, self.inside = None, state.get("inner"), False

    def enter(self, module: nn.Module, *hook_args: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        params, kept, copies = module._parameters, self.kept, self.copies
        if kept is not None and not torch.compiler.is_compiling() and torch.is_grad_enabled():
            copies.use()
            if "forward" not in module.__dict__ and self.put_kept(params):
                self._enter_inner(module)
                return
        self._put(module, params)
        self._enter_inner(module)

    def put_kept(self, params: dict[str, Any]) -> bool:
        """Put what the last call with gradients was given in place again, where it still holds (see the class)."""
        kept = self.kept
        if kept is None:
            return False
        for name, master, version, at, wants, put in kept[0]:
            if (
                params[name] is not master
                or master._version != version
                or master.data_ptr() != at
                or master.requires_grad is not wants
                or put._backward_hooks is not None
            ):
                return False
        params.update(kept[1])
        return True

    def _put(self, module: nn.Module, params: dict[str, Any]) -> None:
        for name, master in self.pairs:
            if params[name] is not master:
                self.depth -= 1
                raise RuntimeError(
                    f"parameter {name!r} of a {type(module).__name__} was replaced after mixprec.prepare "
                    "(fully_shard, load_state_dict(assign=True), to_empty); the prepared optimizer no longer steps "
                    "it. Set the model up first, then build the optimizer and call mixprec.prepare"
                )
        self.kept = None
        if torch.compiler.is_compiling():  # a cast in the graph: fresh whatever wrote the weight
            for name, master in self.pairs:
                params[name] = master.to(self.copies.dtype)  # type: ignore[assignment,union-attr]
        else:
            copies, grad, sparse = self.copies, torch.is_grad_enabled(), self.sparse
            once = self.torch_layer and "forward" not in module.__dict__  # fp8 and per-layer forwards are others
            copies.use()
            held_by, versions, addresses, aliases = copies.copies, copies.versions, copies.addresses, copies.aliases
            entries: list[_Entry] | None = [] if grad and once and not sparse else None
            for name, master in self.pairs:  # ComputeCopies.of and _from_copy written out: the usual case
                held, key = held_by[id(master)], id(master)
                version = master._version  # type: ignore[union-attr]
                if (
                    version != versions[key]
                    or address(master) != addresses.get(key)  # type: ignore[arg-type]
                    or held.shape != master.shape  # type: ignore[union-attr]
                    or held.device != master.device  # type: ignore[union-attr]
                ):
                    held = copies.of(master)  # type: ignore[arg-type]
                wants = master.requires_grad  # type: ignore[union-attr]
                if grad and wants:
                    if not sparse and type(master) is nn.Parameter:
                        kept = aliases.get(key)  # _from_copy's inner alias, made once (see ComputeCopies.aliases)
                        widen = kept[0] if kept is not None and kept[1] is held and kept[2] == version else None
                        if widen is None or widen._backward_hooks is not None:  # none, or a user's hook on it
                            widen = master[...]
                            widen.data = held
                            if type(widen) is torch.Tensor:  # not one a dispatch mode made (a fake tensor)
                                aliases[key] = (widen, held, version)
                        if entries is not None and (aliases.get(key) or (None,))[0] is not widen:
                            entries = None  # made for this call alone: not kept
                        held = widen if once else widen[...]
                    else:
                        held = _from_copy(master, held, sparse)  # type: ignore[arg-type]
                if entries is not None and type(master) is nn.Parameter:
                    entries.append((name, master, version, master.data_ptr(), wants, held))  # type: ignore[union-attr]
                params[name] = held  # type: ignore[assignment]
            if entries is not None and len(entries) == len(self.pairs):
                self.kept = (tuple(entries), {e[0]: e[5] for e in entries})
        if self.rnn:
            module._init_flat_weights()  # type: ignore[operator]

    def _enter_inner(self, module: nn.Module) -> None:
        """An attention's ``out_proj``, whose weight and bias its forward reads without calling it: swapped with it."""
        inner = self.inner
        if inner is not None and "forward" not in module.__dict__ and module._modules.get("out_proj") is inner[0]:
            try:
                inner[1].enter(inner[0])
            except BaseException:
                self.leave(module)
                raise
            self.inside = True

    def leave(self, module: nn.Module, *hook_args: Any) -> None:
        self.depth -= 1
        if self.depth:
            return
        if self.inside:
            self.inside = False
            inner = cast(tuple[nn.Module, _Swap], self.inner)
            inner[1].leave(inner[0])
        module._parameters.update(self.masters)
        if self.rnn:
            module._init_flat_weights()  # type: ignore[operator]


class SwapCall:
    """A module's ``_call_impl`` (its instance's): the copies in place around the class's call, hooks included.

    One Python call a module instead of a pre- and a post-hook (which send every call down ``_call_impl``'s
    slow path): hooks on the module, registered before or after ``prepare``, see the copies. Its own handle:
    ``remove()`` gives the module its class's call back. Picklable and deep-copied with its module.
    """

    __slots__ = ("module", "swap")

    def __init__(self, swap: _Swap, module: nn.Module) -> None:
        self.swap, self.module = swap, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, swap = self.module, self.swap
        swap.enter(module)
        try:
            return type(module)._call_impl(module, *args, **kwargs)  # type: ignore[no-untyped-call]
        finally:
            swap.leave(module)

    def remove(self) -> None:
        if self.module.__dict__.get("_call_impl") is self:
            del self.module.__dict__["_call_impl"]


def install_copies(modules: list[nn.Module], copies: ComputeCopies, handles: list[Any]) -> None:
    """Give each module holding parameters of ``copies`` a :class:`SwapCall` (the root model's is called by
    ``prepare``'s own call, which takes the instance's place); torch's attention's swap enters its ``out_proj``'s."""
    ours = {id(p) for p in copies.params}
    calls: dict[int, SwapCall] = {}
    for module in modules:
        names = [n for n, p in module._parameters.items() if p is not None and id(p) in ours]
        if names:
            call = calls[id(module)] = SwapCall(_Swap(module, names, copies), module)
            module._call_impl = call  # type: ignore[method-assign]
            handles.append(call)
            if call.swap.torch_layer:  # swapped_whole's class test: the forward is tested at each call
                copies.calls.append(call)
    for module in modules:
        attention = calls.get(id(module))
        if attention is not None and type(module) is nn.MultiheadAttention:
            out = calls.get(id(module._modules.get("out_proj")))
            if out is not None:
                attention.swap.inner = (out.module, out.swap)


def swapped_whole(module: nn.Module) -> bool:
    """Whether :func:`enter_whole` puts ``module``'s copies in place for the model's whole call: a torch layer with
    its class's forward (each weight used once, in its own call or read by its parent)."""
    return type(module) in _USED_ONCE and "forward" not in module.__dict__


def enter_whole(copies: ComputeCopies, compiling: bool = False) -> bool:
    """Put every torch layer's copies in place at once for the prepared model's call (with gradients), and, eager,
    lift their calls (:class:`SwapCall`) for its length: one pass over the layers, no Python call a layer call.

    A layer's weight read outside its own call inside the model's forward (a parent's ``F.linear(x,
    self.head.weight)``) is then the copy, as with FSDP2's gathered unit; a layer with a forward of its own (fp8, a
    precision), one being called, or one whose call was removed keeps its own call. ``compiling``: each layer's
    masters cast in the graph instead (its call stays, and passes through), the same values where each is read.
    ``False`` where a call of the model is under way already (a nested call). Undone by :func:`leave_whole`.
    """
    if copies.lifted is not None:
        return False
    lifted: list[SwapCall] = []
    copies.lifted = lifted
    if not compiling:
        copies.use()
    try:
        for call in copies.calls:
            module, swap = call.module, call.swap
            found = module.__dict__
            if found.get("_call_impl") is call and not swap.depth and "forward" not in found:
                if compiling:
                    swap.enter(module)
                    lifted.append(call)
                    continue
                swap.depth = 1  # each is put in place here: an attention's out_proj too (not by its attention)
                if not swap.put_kept(module._parameters):
                    swap.depth = 0
                    swap.enter(module)
                del found["_call_impl"]
                lifted.append(call)
    except BaseException:
        leave_whole(copies)
        raise
    return True


def leave_whole(copies: ComputeCopies) -> None:
    """Give the layers :func:`enter_whole` put in place their masters back, and their calls where it lifted them."""
    lifted, copies.lifted = copies.lifted or [], None
    for call in reversed(lifted):
        module = call.module
        found = module.__dict__
        if "_call_impl" not in found:
            found["_call_impl"] = call  # not through nn.Module.__setattr__
        call.swap.leave(module)

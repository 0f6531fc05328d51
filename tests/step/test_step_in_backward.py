"""``step_in_backward=True``: each parameter stepped as its gradient becomes whole, the gradient freed; bitwise the
plain step at every level and state precision, clipping by the previous step's norm, what is refused."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import bitwise_equal, init_process_group, requires_cuda, spawn, step_ops_at
from mixprec._src.step import step_in_backward


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 10))  # fmt: skip


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
    "adam-l2": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
}


def _run(level: str, optimizer: str = "adamw", steps: int = 6, *, scale_loss_at: int | None = None,
         device: str = "cpu", **options: Any) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:  # fmt: skip
    model = _model().to(device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    model, opt = mixprec.prepare(model, opt, level, **options)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in _batch(step))
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        (loss * (1e3 if step == scale_loss_at else 1.0)).backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return model, opt, losses


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("state", ["fp32", "8bit"])
@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr", "bf16-pure"])
@pytest.mark.parametrize("bucket", ["whole", "a gradient", "none"])
def test_stepping_in_backward_is_the_plain_step_bit_for_bit(
    level: str, state: str, optimizer: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the gradients wait in the bucket until the backward ends (this model's all fit in it), each fills it
    (stepped as it comes, through the bucket), or there is none (clipping's path): the plain step's numbers."""
    plain, plain_opt, _ = _run(level, optimizer, optimizer_state=state)
    monkeypatch.setattr(
        step_in_backward, "BUCKET", {"whole": step_in_backward.BUCKET, "a gradient": 1, "none": 0}[bucket]
    )
    model, opt, _ = _run(level, optimizer, optimizer_state=state, step_in_backward=True)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), _weights(plain), strict=True))
    ours, theirs = opt.state_dict()["state"], plain_opt.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)  # stepped in another order: the entries come in another order
    assert all(bitwise_equal(ours[i], theirs[i]) for i in ours)


@requires_cuda
@pytest.mark.parametrize("state", ["fp32", "8bit", "4bit", "fp8"])
@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr", "bf16-pure", "bf16-kahan"])
def test_on_cuda_stepping_in_backward_is_the_plain_step_bit_for_bit(level: str, state: str) -> None:
    """On the GPU the quantized step is inductor's Triton kernel, bf16-sr's rounding torch's ops."""
    plain, plain_opt, _ = _run(level, optimizer_state=state, device="cuda")
    model, opt, _ = _run(level, optimizer_state=state, step_in_backward=True, device="cuda")
    assert all(p.is_cuda for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), _weights(plain), strict=True))
    ours, theirs = opt.state_dict()["state"], plain_opt.state_dict()["state"]
    assert all(bitwise_equal(ours[i], theirs[i]) for i in ours)


def _alive_after_each_hook(params: list[nn.Parameter]) -> list[list[int]]:
    """The bytes of each gradient alive after each parameter's gradient hooks ran (registered after prepare's, so
    after the parameter was held or stepped)."""
    live: list[list[int]] = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: live.append([q.grad.nbytes for q in params if q.grad is not None])
        )
    return live


@pytest.mark.parametrize("bucket", [20_000, step_in_backward.BUCKET])
def test_gradients_wait_in_a_bucket_and_are_stepped_together(bucket: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On one process without clipping, whole gradients wait until they fill the bucket, then step together and are
    freed; what the bucket holds at ``optimizer.step()`` steps with that step. Fewer than a bucket's bytes wait after
    any gradient's hook; after the step every weight is stepped once and every gradient freed."""
    monkeypatch.setattr(step_in_backward, "BUCKET", bucket)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "O1", step_in_backward=True)
    params = list(model.parameters())
    live = _alive_after_each_hook(params)
    before = _weights(model)
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    assert len(live) == len(params) and all(sum(alive) < bucket for alive in live)
    assert max(map(len, live)) > 1  # several waited together
    held = [p.grad is not None for p in params]  # what the bucket holds for the step
    moved = [not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True)]
    assert moved == [not h for h in held]  # a weight is stepped in backward or waits, not both
    if bucket < sum(p.numel() * 4 for p in params):
        assert any(moved) and any(held)  # a full bucket was stepped in backward, the rest waits
    else:
        assert all(held)  # all of them waited for the step
    opt.step()
    assert all(p.grad is None for p in params) and mixprec.memory_report(model, opt).gradients == 0
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))  # all stepped
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)  # once
    assert mixprec.grad_norm(opt) is not None


def test_a_bucket_left_by_a_backward_that_raised_is_stepped_at_the_step() -> None:
    """A backward that raises leaves what waited in the bucket: it is stepped at ``optimizer.step()``, not dropped
    (nor stepped twice)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "bf16-sr", step_in_backward=True)
    params = list(model.parameters())
    seen: list[int] = []

    def fail_third(p: torch.Tensor) -> None:
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("stop here")

    for p in params:
        p.register_post_accumulate_grad_hook(fail_third)
    before = _weights(model)
    x, y = _batch(0)
    with pytest.raises(RuntimeError, match="stop here"):
        F.cross_entropy(model(x), y).backward()
    waiting = [p.grad is not None for p in params]
    assert sum(waiting) == 3  # held, not stepped
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    opt.step()
    assert all(p.grad is None for p in params)
    assert [not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True)] == waiting
    assert [float(opt.state[p]["step"]) for p, held in zip(params, waiting, strict=True) if held] == [1.0] * 3


@pytest.mark.parametrize("level", ["O1", "bf16-sr"])
def test_the_norm_is_the_same_whether_gradients_wait_in_the_bucket(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mixprec.grad_norm`` bit for bit whether the gradients wait in the bucket or step one by one: their squares
    summed in the order they came, the small parameters' after the others'."""
    norms = []
    for bucket in (step_in_backward.BUCKET, 20_000, 1, 0):  # one bucket, several, one a gradient, none
        monkeypatch.setattr(step_in_backward, "BUCKET", bucket)
        _, opt, _ = _run(level, steps=2, step_in_backward=True)
        norms.append(mixprec.grad_norm(opt))
    assert all(torch.equal(norm, norms[-1]) for norm in norms), norms


def test_clipping_steps_each_large_gradient_as_it_comes_and_the_small_ones_at_the_step() -> None:
    """Clipping scales each gradient by the norm up to it: no bucket. A large parameter's gradient is freed as the
    parameter is stepped; the small ones' (biases, norms, below ``SMALL`` values) wait for ``optimizer.step()``,
    which steps them together."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mixprec.prepare(model, opt, "bf16-sr", optimizer_state="8bit", step_in_backward=True, clip_grad_norm=1e3)
    params = list(model.parameters())
    small = {id(p) for p in params if p.numel() < step_in_backward.SMALL}
    assert 0 < len(small) < len(params)
    live: list[set[int]] = []
    for p in params:  # registered after prepare's: runs once p was stepped
        p.register_post_accumulate_grad_hook(lambda _: live.append({id(q) for q in params if q.grad is not None}))
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    assert len(live) == len(params) and all(alive <= small for alive in live)  # no large gradient waits
    assert live[-1] == small
    kept = sum(p.numel() * p.element_size() for p in params if id(p) in small)
    assert mixprec.memory_report(model, opt).gradients == kept
    before = _weights(model)
    opt.step()  # finishes the step: the large weights were stepped in backward, the small ones now
    assert all(torch.equal(a, b) == (id(p) not in small) for a, b, p in zip(before, _weights(model), params,
                                                                             strict=True))  # fmt: skip
    assert all(p.grad is None for p in params) and mixprec.memory_report(model, opt).gradients == 0
    assert all(not torch.equal(a, b) for a, b in zip(_weights(model), _weights(_model()), strict=True))


@pytest.mark.parametrize("level", ["bf16-sr", "O2"])
def test_the_step_after_a_backward_that_stepped_does_not_grow_with_the_parameters(level: str) -> None:
    """``optimizer.step()`` (the small parameters held back, their norms, the round's end) dispatches as many ops at
    8 blocks as at 2 (within 1.5x): the held gradients' norms in one call, the squares summed in one op."""
    from mixprec.bench import step_cost

    ops, _, _ = step_ops_at(step_cost.Recipe(level, level, step_in_backward=True), 64)
    assert ops[1] <= 1.5 * ops[0], ops


def test_square_norms_in_one_call_are_each_gradients_alone() -> None:
    """The held gradients' squared norms made in one call are each one's own, bit for bit, in order (rows of one
    chunk and of several, an empty one)."""
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=g) * 10).to(dtype) for n in (1, 15, 64, 4097, 70000, 3, 0, 200003) for dtype in
             (torch.bfloat16,)]  # fmt: skip
    together = step_in_backward.square_norms(grads)
    alone = torch.stack([step_in_backward.square_norm(x) for x in grads])
    assert together.shape == (len(grads),) and torch.equal(together, alone)
    kept = [i for i, x in enumerate(grads) if x.numel() <= 1 << 16] * 3  # rows shared out across threads
    assert torch.equal(step_in_backward.square_norms([grads[i] for i in kept]), alone[kept])
    fp32 = [x.float().view(-1, 1) for x in grads]
    assert torch.equal(
        step_in_backward.square_norms(fp32), torch.stack([step_in_backward.square_norm(x) for x in fp32])
    )
    mixed = [x if i % 3 else x.float() for i, x in enumerate(grads)]  # the kept norms' fp32 beside bf16 biases
    assert torch.equal(
        step_in_backward.square_norms(mixed), torch.stack([step_in_backward.square_norm(x) for x in mixed])
    )


def test_clipping_after_backward_is_torchs_clip_grad_norm() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "O1", clip_grad_norm=0.3)
    reference = _model()
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    mixprec.prepare(reference, theirs, "O1")
    for step in range(4):
        x, y = _batch(step)
        for m, o in ((model, opt), (reference, theirs)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            if m is reference:
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3)
            o.step()
        assert torch.equal(mixprec.grad_norm(opt), norm)
    assert norm > 0.3  # it clipped
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), _weights(reference), strict=True))


@pytest.mark.parametrize("level", ["O1", "bf16-sr"])
def test_without_clipping_the_norm_is_every_gradients(level: str) -> None:
    """Not clipping, the step in backward still measures the whole step's gradient norm (``mixprec.grad_norm``):
    the large parameters' gradients as they come, the small ones' at ``optimizer.step()``, as a plain run's
    gradients give it."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, level, step_in_backward=True)
    reference = _model()
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    mixprec.prepare(reference, theirs, level)
    for step in range(3):
        x, y = _batch(step)
        for m, o in ((model, opt), (reference, theirs)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            if m is reference:
                grads = [p.grad.float() for p in m.parameters()]
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            o.step()
        torch.testing.assert_close(mixprec.grad_norm(opt), norm, rtol=1e-5, atol=0)


def _clip_by_the_rule(max_norm: float, steps: int, spike_at: int | None) -> list[torch.Tensor]:
    """The rule written out on a plain prepared run (every gradient at hand after backward): each parameter's
    gradient scaled by max_norm / max(previous step's norm, norm of this backward's gradients up to its own); the
    small parameters' (stepped together at ``optimizer.step()``) by max(previous, norm of all the backward's)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "O1")
    order: list[nn.Parameter] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(order.append)
    previous = None
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        order.clear()
        (F.cross_entropy(model(x), y) * (1e3 if step == spike_at else 1.0)).backward()
        so_far = torch.zeros(())
        small = [p for p in order if p.numel() < step_in_backward.SMALL]
        assert small and len(small) < len(order)
        for p in order:
            so_far = so_far + torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
            bound = so_far.sqrt() if previous is None else torch.maximum(so_far.sqrt(), previous)
            if p.numel() >= step_in_backward.SMALL:
                p.grad.mul_(torch.clamp(max_norm / (bound + 1e-6), max=1.0))
        for p in small:
            p.grad.mul_(torch.clamp(max_norm / (bound + 1e-6), max=1.0))
        previous = so_far.sqrt()
        opt.step()
    return _weights(model)


def _plain(steps: int, spike_at: int | None, **options: Any) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "O1", **options)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * (1e3 if step == spike_at else 1.0)).backward()
        opt.step()
    return _weights(model), opt


@pytest.mark.parametrize("spike_at", [None, 3])
def test_clipping_in_backward_follows_its_rule(spike_at: int | None) -> None:
    clipped, opt = _plain(5, spike_at, step_in_backward=True, clip_grad_norm=0.2)
    expected = _clip_by_the_rule(0.2, 5, spike_at)
    torch.testing.assert_close(clipped, expected, rtol=0, atol=0)  # the per-parameter norms are summed alike
    unclipped, _ = _plain(5, spike_at, step_in_backward=True)
    exact, exact_opt = _plain(5, spike_at, clip_grad_norm=0.2)
    torch.testing.assert_close(mixprec.grad_norm(opt), mixprec.grad_norm(exact_opt), rtol=0.05, atol=0)
    # What the rule changes against exact clipping, after 5 steps (relative distance of the weights; measured:
    # 0.4% without the spike, 2.7% with it) is far less than what leaving clipping out changes (2.5%, 11%).
    assert _distance(clipped, exact) < 0.4 * _distance(unclipped, exact)


def _distance(weights: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    apart = sum(float((a - b).square().sum()) for a, b in zip(weights, reference, strict=True))
    return (apart / sum(float(b.square().sum()) for b in reference)) ** 0.5


def test_a_spike_is_clipped_from_the_gradient_that_shows_it() -> None:
    """Step 3's loss is 1000x: by the previous step's norm alone the spike would go through unclipped; the norm
    so far catches it, and the weights move as far as with exact clipping (measured: within 0.1%; unclipped 16%
    further)."""
    moved = {}
    runs = {"in-backward": {"step_in_backward": True, "clip_grad_norm": 0.2}, "exact": {"clip_grad_norm": 0.2},
            "unclipped": {"step_in_backward": True}}  # fmt: skip
    for name, options in runs.items():
        before, _ = _plain(3, None, **options)
        after, _ = _plain(4, 3, **options)
        moved[name] = sum(float((a - b).norm()) for a, b in zip(after, before, strict=True))
    assert moved["in-backward"] == pytest.approx(moved["exact"], rel=0.01)
    assert moved["unclipped"] > 1.1 * moved["exact"]


def test_the_previous_norm_is_saved_and_a_resumed_run_clips_alike() -> None:
    whole, _ = _plain(6, None, step_in_backward=True, clip_grad_norm=0.2)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "O1", step_in_backward=True, clip_grad_norm=0.2)
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert {g["mixprec_grad_norm"] for g in saved["opt"]["param_groups"]} == {float(mixprec.grad_norm(opt))}
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "O1", step_in_backward=True, clip_grad_norm=0.2)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert "mixprec_grad_norm" not in opt.param_groups[0]
    for step in range(3, 6):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), whole, strict=True))


def test_accumulating_gradients_is_refused() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mixprec.prepare(model, opt, "bf16-sr", step_in_backward=True)
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="cannot be accumulated"):
        F.cross_entropy(model(x), y).backward()


def test_what_cannot_step_in_backward_is_refused() -> None:
    with pytest.raises(ValueError, match="fp16 needs that"):
        mixprec.PrepareConfig(level="O2", dtype=torch.float16, step_in_backward=True)
    model = _model()
    with pytest.raises(ValueError, match="LBFGS"):
        mixprec.prepare(model, torch.optim.LBFGS(model.parameters()), "O1", step_in_backward=True)
    with pytest.raises(ValueError, match="positive finite"):
        mixprec.PrepareConfig(clip_grad_norm=0.0)
    opt = torch.optim.AdamW(model.parameters())
    mixprec.prepare(model, opt, "O1", step_in_backward=True)
    scaler = mixprec.GradScaler("cpu")
    x, y = _batch(0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    with pytest.raises(RuntimeError, match="step_in_backward=True"):
        scaler.step(opt)
    disabled = mixprec.GradScaler("cpu", enabled=False)  # bf16 needs no scaling: a disabled scaler just steps
    disabled.step(opt)


def test_a_shared_weight_is_stepped_once_with_its_whole_gradient() -> None:
    def tied() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        embed, head = nn.Embedding(50, 64), nn.Linear(64, 50, bias=False)
        head.weight = embed.weight
        model = nn.Sequential(embed, nn.Linear(64, 64), head)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    results = []
    for in_backward in (False, True):
        model, opt = tied()
        mixprec.prepare(model, opt, "bf16-sr", step_in_backward=in_backward)
        for step in range(3):
            tokens = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(step))
            F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        results.append(_weights(model))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_activation_checkpointing_and_export() -> None:
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    results = []
    for in_backward in (False, True):
        model = Checkpointed()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mixprec.prepare(model, opt, "bf16-sr", optimizer_state="8bit", step_in_backward=in_backward)
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        results.append(_weights(model))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    mixprec.export_fp32(model, opt)
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())  # exported: gradients are kept again


def _ddp_worker(rank: int, world: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    init_process_group(rank, world, port)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mixprec.prepare(model, opt, "bf16-sr", step_in_backward=True)
    ddp = nn.parallel.DistributedDataParallel(model)
    x, y = _batch(rank)
    try:
        F.cross_entropy(ddp(x), y).backward()
        results[rank] = {"error": ""}
    except RuntimeError as error:
        results[rank] = {"error": str(error)}
    dist.destroy_process_group()


def test_ddp_is_refused_before_a_rank_steps_its_own_gradient() -> None:
    ranks = spawn(_ddp_worker, 2)
    assert all("before DDP" in rank["error"] for rank in ranks)


def _sharded_worker(rank: int, world: int, port: int, results: Any, level: str) -> None:
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from mixprec.bench.workloads import TinyLM

    warnings.filterwarnings("ignore")
    init_process_group(rank, world, port)
    out: dict[str, Any] = {}
    for name, options in {"plain": {}, "in-backward": {"step_in_backward": True},
                          "clipped": {"step_in_backward": True, "clip_grad_norm": 0.5},
                          "exact": {"clip_grad_norm": 0.5}}.items():  # fmt: skip
        torch.manual_seed(0)
        model = TinyLM(vocab=256, dim=64, layers=2, heads=4)
        for layer in model.blocks.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        mixprec.prepare(model, opt, level, optimizer_state="8bit", **options)
        live = []
        for step in range(4):
            tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(step))
            x, y = tokens[:, :-1].chunk(world)[rank], tokens[:, 1:].chunk(world)[rank]
            opt.zero_grad()
            F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
            live.append(sum(p.grad is not None for p in model.parameters()))
            opt.step()
        out[name] = {"weights": [p.full_tensor().detach().clone() for p in model.parameters()], "live": live,
                     "norm": float(mixprec.grad_norm(opt)) if name != "plain" else 0.0}  # fmt: skip
    results[rank] = out
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "level", ["bf16-sr", pytest.param("O2", marks=pytest.mark.slow), pytest.param("bf16-kahan", marks=pytest.mark.slow)]
)
def test_under_fsdp2_each_unit_steps_after_its_reduce_scatter(level: str) -> None:
    ranks = spawn(_sharded_worker, 2, level)
    for rank in ranks:
        assert all(bitwise_equal(a, b) for a, b in zip(rank["in-backward"]["weights"], rank["plain"]["weights"],
                                                        strict=True))  # fmt: skip
        assert rank["in-backward"]["live"] == [0] * 4
        assert rank["plain"]["live"][0] > 0
    # the norm is summed over ranks: every rank clips alike, and measures the norm exact clipping measures
    assert ranks[0]["clipped"]["norm"] == ranks[1]["clipped"]["norm"]
    assert ranks[0]["clipped"]["norm"] == pytest.approx(ranks[0]["exact"]["norm"], rel=0.05)
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0]["clipped"]["weights"], ranks[0]["in-backward"]["weights"],
                                                      strict=True))  # fmt: skip

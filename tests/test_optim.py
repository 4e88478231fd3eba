"""DP optimizer: noise once per logical batch, its std, the ledger, seeds, checkpoints."""

import copy
import math
import re

import pytest
import torch
from torch import nn

from dptrain.accounting import PrivacyLedger
from dptrain.clipping import ClippingEngine
from dptrain.optim import DPOptimizer, PrivacyBudgetExhaustedError, noisy_clipped_gradient


def make(model, sigma=1.5, c=0.7, batch=8.0, seed=0, **kw):
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        noise_multiplier=sigma,
        max_grad_norm=c,
        expected_batch_size=batch,
        sample_rate=0.01,
        seed=seed,
        **kw,
    )


def test_noise_std_is_sigma_times_c():
    """Sample variance of 200,000 noise coordinates against a chi-square bound."""
    model = nn.Linear(400, 500, bias=False)
    opt = make(model, sigma=1.5, c=0.7, batch=8.0)
    opt.zero_grad()
    model.weight.grad = torch.zeros_like(model.weight)
    opt.add_noise()
    noise = model.weight.grad.flatten().double() * 8.0
    n = noise.numel()
    ratio = float(noise.var() / (1.5 * 0.7) ** 2)
    # var/sigma^2 ~ chi2(n-1)/(n-1): std sqrt(2/n) ~ 0.0032; allow 5 standard deviations.
    assert abs(ratio - 1) < 5 * math.sqrt(2 / n)
    assert abs(float(noise.mean())) < 5 * 1.05 / math.sqrt(n)


def test_noise_added_once_per_logical_step_and_ledger_counts_steps():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = ClippingEngine(model, 1.0)
    opt = make(model, seed=3)
    x = torch.randn(12, 3)
    for _ in range(4):
        opt.zero_grad()
        for chunk in x.split(5):  # three physical chunks
            engine.backward(model(chunk).pow(2).sum(1))
        opt.step()
    assert opt.steps_taken == 4
    assert opt.ledger.num_steps == 4
    assert opt.ledger.segments[0].sample_rate == 0.01


def test_chunked_and_unchunked_steps_are_identical():
    def run(chunk):
        torch.manual_seed(0)
        model = nn.Linear(3, 2).double()
        engine = ClippingEngine(model, 0.5)
        opt = make(model, seed=11)
        x = torch.randn(12, 3, dtype=torch.float64)
        for _ in range(3):
            opt.zero_grad()
            for part in x.split(chunk):
                engine.backward(model(part).pow(2).sum(1))
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.allclose(run(12), run(5), rtol=0, atol=1e-12)


def test_seeds_reproduce_and_os_seeds_differ():
    def noise(seed):
        model = nn.Linear(5, 5)
        opt = make(model, seed=seed)
        opt.zero_grad()
        opt.add_noise()
        return model.weight.grad.clone(), opt.seed

    a, seed_a = noise(7)
    b, _ = noise(7)
    assert seed_a == 7 and torch.equal(a, b)
    c, seed_c = noise(None)
    d, seed_d = noise(None)
    assert seed_c != seed_d and not torch.equal(c, d)
    again, _ = noise(seed_c)  # the logged OS seed reproduces the run
    assert torch.equal(again, c)


def test_state_dict_resumes_noise_ledger_and_optimizer():
    """Save after 2 steps, take a 3rd; a new optimizer loaded from the save takes the same 3rd."""
    torch.manual_seed(0)
    model_a, model_b = nn.Linear(4, 3), nn.Linear(4, 3)
    opt_a = DPOptimizer(
        torch.optim.Adam(model_a.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
        sample_rate=0.01,
        seed=5,
    )
    for _ in range(2):
        opt_a.zero_grad()
        opt_a.step()
    saved_params = {k: v.clone() for k, v in model_a.state_dict().items()}
    saved_opt = copy.deepcopy(opt_a.state_dict())  # as torch.save would
    opt_a.zero_grad()
    opt_a.step()

    model_b.load_state_dict(saved_params)
    opt_b = DPOptimizer(  # an OS seed: the loaded state must override it
        torch.optim.Adam(model_b.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
        sample_rate=0.01,
    )
    opt_b.load_state_dict(saved_opt)
    opt_b.zero_grad()
    opt_b.step()
    assert torch.equal(model_b.weight, model_a.weight)
    assert opt_b.ledger == opt_a.ledger and opt_b.ledger.num_steps == 3
    assert opt_b.seed == 5


def test_budget_is_enforced():
    model = nn.Linear(2, 2)
    opt = make(model, max_steps=2)
    for _ in range(2):
        opt.zero_grad()
        opt.step()
    with pytest.raises(PrivacyBudgetExhaustedError, match=r"^the privacy budget allows 2 steps"):
        opt.step()
    assert opt.ledger.num_steps == 2


def test_lr_scheduler_attaches_to_the_dp_optimizer():
    model = nn.Linear(2, 2)
    opt = make(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for _ in range(3):
        opt.zero_grad()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)


def test_loss_scale_rule_is_equivalent_to_no_scaling():
    """Li et al. App. T: clip at C K, noise x K, unscale = clip at C, noise, no scale."""

    def run(k):
        torch.manual_seed(0)
        model = nn.Linear(3, 2).double()
        engine = ClippingEngine(model, 0.5)
        opt = make(model, seed=2)
        x = torch.randn(6, 3, dtype=torch.float64)
        opt.zero_grad()
        engine.backward(k * model(x).pow(2).sum(1), loss_scale=k)
        opt.step(loss_scale=k)
        return model.weight.detach().clone()

    assert torch.allclose(run(1.0), run(1024.0), rtol=0, atol=1e-12)


def test_closure_is_refused():
    opt = make(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=re.escape("closure= is not supported")):
        opt.step(lambda: 0.0)


def test_low_level_api_gives_noised_average():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    engine = ClippingEngine(model, 1.0)
    x = torch.randn(5, 3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    stats = noisy_clipped_gradient(
        engine, model(x).pow(2).sum(1), noise_multiplier=0.8, expected_batch_size=5, generator=gen
    )
    assert stats.batch_size == 5
    noisy = model.weight.grad.clone()
    # The same clipped sum without noise, plus the same draw, divided by 5.
    model.zero_grad()
    engine.backward(model(x).pow(2).sum(1))
    gen2 = torch.Generator().manual_seed(4)
    z = torch.normal(0.0, 0.8, size=model.weight.shape, generator=gen2, dtype=torch.float64)
    assert torch.allclose(noisy, (model.weight.grad + z) / 5, atol=1e-12)


def test_ledger_given_is_continued():
    ledger = PrivacyLedger()
    ledger.record(0.01, 1.5, 10)
    opt = make(nn.Linear(2, 2), ledger=ledger)
    opt.zero_grad()
    opt.step()
    assert ledger.num_steps == 11


# -- the step refuses gradients the engine did not clip -------------------------------------


def _private_pair(model=None, seed=0):
    torch.manual_seed(seed)
    if model is None:
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    engine = ClippingEngine(model, 1.0)
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4.0,
        sample_rate=0.5,
        engine=engine,
    )
    return model, engine, opt


def test_a_plain_backward_before_the_step_is_refused():
    from dptrain.clipping import UnclippedGradientError, UnsupportedModelError

    model, engine, opt = _private_pair()
    x = torch.randn(4, 3)
    opt.zero_grad()
    engine.backward(model(x).pow(2).sum(1))
    model(x).sum().backward()  # unclipped, straight into p.grad
    with pytest.raises(
        UnclippedGradientError, match=r"^p\.grad of 0\.weight, 0\.bias, 2\.weight"
    ) as e:
        opt.step()
    # the model is fine: the call is what to change, and the message says to what
    assert not isinstance(e.value, UnsupportedModelError)
    assert "Instead of loss.backward(), pass the per-example losses" in str(e.value)
    assert "private.backward(losses)" in str(e.value)
    assert opt.steps_taken == 0 and len(opt.ledger) == 0


def test_a_gradient_left_from_the_last_step_is_refused():
    from dptrain.clipping import UnclippedGradientError

    model, engine, opt = _private_pair()
    x = torch.randn(4, 3)
    opt.zero_grad()
    engine.backward(model(x).pow(2).sum(1))
    opt.step()
    # no zero_grad(): p.grad still holds the last step's noised average
    with pytest.raises(UnclippedGradientError, match=re.escape("Call optimizer.zero_grad()")):
        engine.backward(model(x).pow(2).sum(1))
    opt.zero_grad()
    engine.backward(model(x).pow(2).sum(1))
    opt.step()
    assert opt.steps_taken == 2


def test_a_parameter_made_trainable_after_the_engine_is_refused():
    from dptrain.clipping import UnsupportedModelError

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    model, engine, opt = _private_pair(model)
    model[0].requires_grad_(True)
    opt.zero_grad()
    engine.backward(model(torch.randn(4, 3)).pow(2).sum(1))
    with pytest.raises(
        UnsupportedModelError,
        match=re.escape(
            "trainable parameters the clipping engine does not clip: 0.weight, 0.bias (made "
            "trainable after the engine was built?)"
        ),
    ):
        opt.step()


def _state_after_two_steps_and_third_weight(seed: int = 5):
    """A DPOptimizer (SGD: no per-parameter state) saved after 2 steps, and the weight
    its 3rd step gives."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = make(model, seed=seed)
    for _ in range(2):
        opt.zero_grad()
        opt.step()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    opt.step()
    return start, saved, model.weight.detach().clone()


def test_state_moved_to_cuda_by_accelerate_resumes_the_noise(monkeypatch):
    """accelerate's move_to_device sends every tensor of the state to the GPU, the noise
    generators' ByteTensors too (DPTrainer crashed on CUDA before its first step)."""
    pytest.importorskip("accelerate")
    from accelerate.optimizer import move_to_device

    from tests.fake_device import FakeCudaTensor, to_fake_cuda

    start, saved, third = _state_after_two_steps_and_third_weight()
    with monkeypatch.context() as m:
        to_fake_cuda(m)
        moved = move_to_device(saved, "cuda")
    assert all(isinstance(s, FakeCudaTensor) for s in moved["generators"].values())
    model = nn.Linear(4, 3)
    model.load_state_dict(start)
    opt = make(model, seed=None)
    opt.load_state_dict(moved)
    opt.zero_grad()
    opt.step()
    assert torch.equal(model.weight, third)
    assert opt.seed == 5


def test_accelerated_optimizer_round_trip_keeps_the_noise():
    """AcceleratedOptimizer (device placement on) reloads the state at wrap time and
    delegates state_dict/load_state_dict: the noise stream continues."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # the state AcceleratedOptimizer reads its device from
    start, saved, third = _state_after_two_steps_and_third_weight()
    model = nn.Linear(4, 3)
    model.load_state_dict(start)
    opt = AcceleratedOptimizer(make(model, seed=None), device_placement=True)
    opt.load_state_dict(saved)
    opt.zero_grad()
    opt.step()
    assert torch.equal(model.weight, third)


def test_generator_keys_name_the_device_index():
    """The key is the parameter's device (cuda:0), never a bare cuda that a second,
    freshly seeded generator would answer to."""
    opt = make(nn.Linear(2, 2))
    assert list(opt.state_dict()["generators"]) == ["cpu"]


class _HostReads:
    """Counts the reads of a tensor's values by the host (item, tolist, float, int, bool,
    cpu, numpy). On a GPU each one waits for every kernel queued before it."""

    METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(t, *args, _original=original, **kwargs):
                self.count += 1
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
@pytest.mark.parametrize("amp", [False, True], ids=["float32", "bf16-autocast"])
def test_a_steady_private_step_reads_the_device_once(monkeypatch, mode, amp):
    """Forward, clipped backward and noised step of a tied Llama, after the first step (whose
    checks read what they compare): the host reads one value more than in the non-private
    step, the diagnostics' norms (StepMetrics), read together. A read per parameter or
    per module would stall a GPU's queue hundreds of times a step."""
    from tests.clipping.hf_zoo import llama, token_losses

    case = llama(tied=True)
    kwargs, labels = case.make_batch(4, 8, 0)
    plain = case.model.float()
    private = copy.deepcopy(plain)
    engine = ClippingEngine(private, 1.0, mode=mode)
    opt = make(private)
    sgd = torch.optim.SGD(plain.parameters(), lr=1.0)

    def autocast():
        return torch.autocast("cpu", torch.bfloat16, enabled=amp)

    def private_step():
        opt.zero_grad()
        with autocast():
            losses = token_losses(private(**kwargs), labels)
        engine.backward(losses)
        opt.step()

    def plain_step():
        sgd.zero_grad()
        with autocast():
            token_losses(plain(**kwargs), labels).mean().backward()
        sgd.step()

    for _ in range(2):
        private_step()
        plain_step()
    reads = _HostReads(monkeypatch)
    plain_step()
    plain_reads = reads.count
    private_step()
    assert reads.count - plain_reads == plain_reads + 1

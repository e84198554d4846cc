"""AdamTensorFlowStyle against an independent float64 NumPy version of TF1's AdamOptimizer update (spec O1-O3, TV8);
make_optimizer's AdamW with decoupled weight decay (nplus N8) and the scripts' --weight_decay."""

import json

import numpy as np
import pytest
import torch

import train_policy
import train_reward
from lm_human_preference_details import cli, optim
from lm_human_preference_details.optim import AdamTensorFlowStyle, make_optimizer
from lm_human_preference_details.settings import with_run
from tests.conftest import write_queries
from tests.memory import PeakAllocation
from tests.test_train_policy import save_reward_model, tiny_args, tiny_task

BETA1, BETA2, EPS = 0.9, 0.999, 1e-5
NUM_STEPS = 50


def grad_schedule(num_steps: int = NUM_STEPS) -> np.ndarray:
    """(num_steps, 16) gradients whose magnitudes span 1e-7 ... 1, with signs and sizes varying over time."""
    scales = np.logspace(-7, 0, 16)
    t = np.arange(num_steps)[:, None]
    i = np.arange(16)[None, :]
    return scales * np.sin(0.7 * t + 1.3 * i + 0.1) * (1.0 + 0.5 * np.cos(0.3 * t))


def tf1_adam_reference(p0: np.ndarray, grads: np.ndarray, lrs: list[float]) -> np.ndarray:
    """TF1 Adam in float64: m, v as usual; p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)."""
    p, m, v = p0.astype(np.float64), np.zeros_like(p0, np.float64), np.zeros_like(p0, np.float64)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        m = BETA1 * m + (1 - BETA1) * g
        v = BETA2 * v + (1 - BETA2) * g * g
        lr_t = lr * np.sqrt(1 - BETA2**t) / (1 - BETA1**t)
        p = p - lr_t * m / (np.sqrt(v) + EPS)
    return p


def run_optimizer(optimizer_cls, p0: np.ndarray, grads: np.ndarray, lrs: list[float], dtype: torch.dtype, **kwargs):
    """Apply `grads` step by step to a parameter initialized at p0, setting the group lr before each step."""
    param = torch.nn.Parameter(torch.tensor(p0, dtype=dtype))
    optimizer = optimizer_cls([param], lr=lrs[0], betas=(BETA1, BETA2), eps=EPS, **kwargs)
    for g, lr in zip(grads, lrs):
        optimizer.param_groups[0]["lr"] = lr
        param.grad = torch.tensor(g, dtype=dtype)
        optimizer.step()
    return param.detach().double().numpy()


def test_adam_tf_style_matches_closed_form_float64():
    grads = grad_schedule()
    p0 = np.random.default_rng(0).normal(size=16)
    lrs = [1e-3] * NUM_STEPS
    ours = run_optimizer(AdamTensorFlowStyle, p0, grads, lrs, torch.float64)
    expected = tf1_adam_reference(p0, grads, lrs)
    np.testing.assert_allclose(ours - p0, expected - p0, rtol=1e-12, atol=0)


def test_adam_tf_style_matches_closed_form_float32():
    grads = grad_schedule()
    p0 = np.random.default_rng(1).normal(size=16).astype(np.float32).astype(np.float64)
    lrs = [1e-3] * NUM_STEPS
    ours = run_optimizer(AdamTensorFlowStyle, p0, grads.astype(np.float32), lrs, torch.float32)
    expected = tf1_adam_reference(p0, grads.astype(np.float32).astype(np.float64), lrs)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)


def test_adam_tf_style_differs_from_torch_adam_at_small_gradients():
    # grad 1e-7: TF's first step is lr * sqrt(1 - b2) * g / (sqrt(1 - b2) * g + eps) ~ 3.2e-4 * lr, torch's
    # lr * g / (g + eps) ~ 1e-2 * lr, because torch's effective epsilon is eps * sqrt(1 - b2^t)
    grads = np.full((1, 4), 1e-7)
    p0 = np.zeros(4)
    tf_step = run_optimizer(AdamTensorFlowStyle, p0, grads, [1e-3], torch.float64)
    torch_step = run_optimizer(torch.optim.Adam, p0, grads, [1e-3], torch.float64)
    np.testing.assert_allclose(tf_step, tf1_adam_reference(p0, grads, [1e-3]), rtol=1e-12)
    assert np.all(np.abs(torch_step) > 20 * np.abs(tf_step))


def test_adam_tf_style_differs_from_torch_adam_over_schedule():
    grads = grad_schedule()
    p0 = np.zeros(16)
    lrs = [1e-3] * NUM_STEPS
    expected = tf1_adam_reference(p0, grads, lrs)
    torch_adam = run_optimizer(torch.optim.Adam, p0, grads, lrs, torch.float64)
    small = slice(0, 6)  # gradients below ~1e-4, where eps dominates the denominator
    assert np.all(np.abs(torch_adam[small] - expected[small]) > 2 * np.abs(expected[small]))


def test_adam_tf_style_lr_change_between_steps_takes_effect():
    grads = grad_schedule(10)
    p0 = np.random.default_rng(2).normal(size=16)
    lrs = [1e-3, 1e-3, 5e-4, 0.0, 2e-3, 1e-4, 1e-4, 0.0, 3e-3, 1e-3]
    ours = run_optimizer(AdamTensorFlowStyle, p0, grads, lrs, torch.float64)
    np.testing.assert_allclose(ours - p0, tf1_adam_reference(p0, grads, lrs) - p0, rtol=1e-12, atol=0)
    constant_lr = run_optimizer(AdamTensorFlowStyle, p0, grads, [1e-3] * 10, torch.float64)
    assert np.abs(ours - constant_lr).max() > 1e-4


def test_adam_tf_style_skips_params_without_grad_and_groups_keep_own_lr():
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    c = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    optimizer = AdamTensorFlowStyle([{"params": [a, b]}, {"params": [c], "lr": 1e-2}], lr=1e-3)
    a.grad = torch.full_like(a, 0.5)
    c.grad = torch.full_like(c, 0.5)
    optimizer.step()
    grads = np.full((1, 3), 0.5)
    np.testing.assert_allclose(a.detach().numpy(), tf1_adam_reference(np.ones(3), grads, [1e-3]), rtol=1e-12)
    np.testing.assert_allclose(c.detach().numpy(), tf1_adam_reference(np.ones(3), grads, [1e-2]), rtol=1e-12)
    assert torch.equal(b.detach(), torch.ones(3, dtype=torch.float64))
    assert b not in optimizer.state


def test_adam_tf_style_state_dict_roundtrip_continues_identically():
    grads = grad_schedule(6)
    p0 = np.random.default_rng(3).normal(size=16)
    full = run_optimizer(AdamTensorFlowStyle, p0, grads, [1e-3] * 6, torch.float64)

    param = torch.nn.Parameter(torch.tensor(p0))
    optimizer = AdamTensorFlowStyle([param], lr=1e-3)
    for g in grads[:3]:
        param.grad = torch.tensor(g)
        optimizer.step()
    saved = optimizer.state_dict()
    resumed = AdamTensorFlowStyle([param], lr=1e-3)
    resumed.load_state_dict(saved)
    assert resumed.state[param]["step"] == 3
    for g in grads[3:]:
        param.grad = torch.tensor(g)
        resumed.step()
    np.testing.assert_array_equal(param.detach().numpy(), full)


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(betas=(1.0, 0.999)), dict(eps=-1e-5)])
def test_adam_tf_style_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError, match="invalid"):
        AdamTensorFlowStyle([torch.nn.Parameter(torch.zeros(1))], **kwargs)


def _layers(count: int, numel: int, seed: int) -> list[torch.nn.Parameter]:
    """`count` float32 parameters of `numel` elements with random gradients."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-7, 1, (numel,), generator=gen)
    return params


def test_adam_tf_style_step_holds_temporaries_of_one_bucket_not_of_the_model(monkeypatch):
    # GPU memory proxy: the step's g^2 and sqrt(v) + eps exist for one bucket of parameters at a time, not for all
    # of them (8 MiB of parameters, 1 MiB each, buckets of 2 MiB)
    monkeypatch.setattr(optim, "STEP_BUCKET_BYTES", 2 * 2**20)
    params = _layers(8, 2**18, seed=0)
    optimizer = AdamTensorFlowStyle(params, lr=1e-3)
    optimizer.step()  # allocates the moments (state, not temporaries)
    with PeakAllocation() as memory:
        optimizer.step()
    assert memory.peak <= 2 * 2**20, memory.peak


def test_adam_tf_style_bucketed_step_equals_one_step_over_all_parameters(monkeypatch):
    # the buckets change where the temporaries live, not one bit of the update
    results = []
    for bucket_bytes in (2**40, 3 * 4 * 1000):  # all at once; buckets of 3 parameters, one of a bucket alone
        monkeypatch.setattr(optim, "STEP_BUCKET_BYTES", bucket_bytes)
        params = _layers(7, 1000, seed=1)
        params[2:2] = _layers(1, 5000, seed=2)  # larger than a bucket
        optimizer = AdamTensorFlowStyle(params, lr=1e-3)
        for step in range(4):
            for p in params:
                p.grad.mul_(-0.7 if step % 2 else 1.3)
            optimizer.step()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], _layers(7, 1000, seed=1)[0].detach())


# ---------------------------------------------------------------- --weight_decay: torch AdamW (nplus N8)


def adamw_reference(p0: np.ndarray, grads: np.ndarray, lr: float, weight_decay: float) -> np.ndarray:
    """torch's AdamW in float64: p *= 1 - lr * wd (decoupled, before the step), then Adam with eps added to the
    bias-corrected sqrt(v): p -= lr * m_hat / (sqrt(v_hat) + eps)."""
    p, m, v = p0.astype(np.float64), np.zeros_like(p0, np.float64), np.zeros_like(p0, np.float64)
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * weight_decay)
        m = BETA1 * m + (1 - BETA1) * g
        v = BETA2 * v + (1 - BETA2) * g * g
        m_hat, v_hat = m / (1 - BETA1**t), v / (1 - BETA2**t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + EPS)
    return p


def make_optimizer_run(
    p0: np.ndarray, grads: np.ndarray, lr: float, **kwargs
) -> tuple[np.ndarray, torch.optim.Optimizer]:
    """Steps of the scripts' optimizer (make_optimizer) on a float64 parameter initialized at p0."""
    param = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    optimizer = make_optimizer([param], lr, **kwargs)
    for g in grads:
        param.grad = torch.tensor(g, dtype=torch.float64)
        optimizer.step()
    return param.detach().numpy(), optimizer


def test_make_optimizer_weight_decay_is_adamw_decoupled_decay_with_eps_1e5():
    # nplus N8: the successor recipe trains with torch.optim.AdamW(lr, eps=1e-5), weight decay 0.01; a large decay
    # here (lr * wd = 5e-3 per step) so that decoupled decay, L2 added to the gradient and no decay all differ
    grads = grad_schedule(20)
    p0 = np.random.default_rng(4).normal(size=16)
    lr, weight_decay = 1e-2, 0.5
    ours, optimizer = make_optimizer_run(p0, grads, lr, use_tensorflow_adam=False, weight_decay=weight_decay)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["eps"] == 1e-5
    np.testing.assert_allclose(ours, adamw_reference(p0, grads, lr, weight_decay), rtol=1e-12, atol=1e-15)
    no_decay = adamw_reference(p0, grads, lr, 0.0)
    assert np.abs(ours - no_decay).max() > 1e-3


@pytest.mark.parametrize("use_tensorflow_adam", [True, False])
def test_make_optimizer_without_weight_decay_keeps_oais_and_the_ablations_optimizer(use_tensorflow_adam):
    # weight decay 0 (every OAI preset) builds exactly the optimizer of before: TF1 Adam, or torch.optim.Adam (not
    # AdamW, whose state dict differs), eps 1e-5, and its numbers
    grads = grad_schedule(10)
    p0 = np.random.default_rng(5).normal(size=16)
    ours, optimizer = make_optimizer_run(p0, grads, 1e-3, use_tensorflow_adam=use_tensorflow_adam)
    expected_class = AdamTensorFlowStyle if use_tensorflow_adam else torch.optim.Adam
    assert type(optimizer) is expected_class and optimizer.defaults["eps"] == 1e-5
    assert optimizer.defaults.get("weight_decay", 0) == 0
    same, _ = make_optimizer_run(p0, grads, 1e-3, use_tensorflow_adam=use_tensorflow_adam, weight_decay=0.0)
    np.testing.assert_array_equal(ours, same)
    if use_tensorflow_adam:
        np.testing.assert_allclose(ours - p0, tf1_adam_reference(p0, grads, [1e-3] * 10) - p0, rtol=1e-12, atol=0)
    else:
        np.testing.assert_array_equal(ours, run_optimizer(torch.optim.Adam, p0, grads, [1e-3] * 10, torch.float64))


@pytest.mark.parametrize("weight_decay", [-0.01, float("nan"), float("inf")])
def test_make_optimizer_rejects_a_weight_decay_that_is_not_a_number_at_least_zero(weight_decay):
    with pytest.raises(ValueError, match=r"^--weight_decay must be a finite number >= 0"):
        make_optimizer([torch.nn.Parameter(torch.zeros(1))], 1e-3, False, weight_decay)


def run_cli(script, argv: list[str], capsys) -> tuple[int, str]:
    """`python script.py ARGV` through cli.run; -> exit code, stderr."""
    capsys.readouterr()
    try:
        cli.run(script.main, script.parse, argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("script", [train_policy, train_reward])
def test_weight_decay_with_tensorflow_adam_stops_in_one_line_naming_both_flags(
    script, tmp_path, tiny_model_dir, capsys
):
    # OAI's TF1 Adam has no weight decay: asking for one without --no_use_tensorflow_adam is a mistake, caught
    # before anything loads (also by --dry_run), not silently ignored
    other = ["--rewards.trained_model", "vader"] if script is train_policy else ["--label_dataset", "labels.json"]
    argv = ["--base_model", tiny_model_dir, *other, "--weight_decay", "0.01", "--output_dir", str(tmp_path / "out")]
    code, err = run_cli(script, [*argv, "--dry_run"], capsys)
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[0]
    assert line.startswith("error: --weight_decay 0.01 needs --no_use_tensorflow_adam"), err
    assert "--weight_decay 0" in line and "no weight decay" in line
    assert not (tmp_path / "out").exists()


class OptimizerBuilt(Exception):
    """Stops a script's run once its optimizer exists."""


def stop_at_optimizer(monkeypatch, script) -> list[torch.optim.Optimizer]:
    """Make `script` build its optimizer with the real make_optimizer, record it, then stop the run."""
    built = []

    def record(*args, **kwargs):
        built.append(make_optimizer(*args, **kwargs))
        raise OptimizerBuilt

    monkeypatch.setattr(script, "make_optimizer", record)
    return built


def test_train_policy_weight_decay_gives_adamw_over_the_trained_parameters(tmp_path, tiny_model_dir, monkeypatch):
    queries = write_queries(tmp_path / "queries.txt")
    reward = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(queries))
    args = tiny_args(tmp_path / "policy", tiny_model_dir, reward, queries)
    args.use_tensorflow_adam, args.weight_decay = False, 0.01
    built = stop_at_optimizer(monkeypatch, train_policy.optim)
    with pytest.raises(OptimizerBuilt):
        train_policy.main(args)
    (optimizer,) = built
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["weight_decay"] == 0.01 and optimizer.defaults["eps"] == 1e-5
    assert optimizer.defaults["lr"] == args.ppo.lr
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) > 10_000  # the policy and its value head


def test_train_reward_weight_decay_gives_adamw(tmp_path, tiny_model_dir, monkeypatch):
    queries = write_queries(tmp_path / "queries.txt")
    rows = [{"query": [100 + i] * 16, **{f"sample{k}": [200 + k] * 8 for k in range(4)}, "best": 0} for i in range(16)]
    (tmp_path / "labels.json").write_text(json.dumps(rows))
    task = tiny_task(queries)
    args = train_reward.Args(
        base_model=tiny_model_dir,
        label_dataset=str(tmp_path / "labels.json"),
        task=task,
        batch_size=8,
        rollout_batch_size=8,
        normalize_samples=8,
        use_tensorflow_adam=False,
        weight_decay=0.01,
    )
    args = with_run(args, output_dir=str(tmp_path / "rm"))
    args.labels.num_train = 16
    built = stop_at_optimizer(monkeypatch, train_reward)
    with pytest.raises(OptimizerBuilt):
        train_reward.main(args)
    (optimizer,) = built
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["weight_decay"] == 0.01 and optimizer.defaults["lr"] == args.lr

"""benchmark/policy_throughput.py: --compile_sampler while host syncs are counted; the GEMM bound on the run's device"""

import re

import pytest
import torch

from benchmark import policy_throughput
from lm_human_preference_details import decoding_graph

pytestmark = pytest.mark.usefixtures("single_thread")


def test_benchmark_counts_the_host_syncs_of_the_captured_sampler(monkeypatch, tmp_path, capsys):
    captures, replays = [], []

    class RecordingGraph(decoding_graph.EagerStepGraph):
        def capture(self, step):
            super().capture(step)
            captures.append(self)

        def replay(self):
            super().replay()
            replays.append(self)

    monkeypatch.setattr(decoding_graph, "new_step_graph", RecordingGraph)
    devices = []
    measure = policy_throughput.measure_gemm_seconds

    def recording_measure(g, repeats, device=None):
        devices.append(device)
        return measure(g, repeats, device)

    monkeypatch.setattr(policy_throughput, "measure_gemm_seconds", recording_measure)
    # 16 decoding steps per update (the sentiment preset truncates after 16 response tokens, so 17)
    args = policy_throughput.Args(
        updates=1,
        warmup=1,
        batch=8,
        query_length=8,
        response_length=17,
        noptepochs=1,
        gemm_repeats=1,
        compile_sampler=True,
        work_dir=str(tmp_path),
    )
    policy_throughput.main(args)
    out = capsys.readouterr().out
    # the step was captured in the warm-up update and replayed at every step of the timed one, under the counter
    assert len(captures) == 1 and len(replays) >= 16
    syncs = re.search(r"host syncs per update \[(\d+)\]", out)
    assert syncs and int(syncs.group(1)) <= 2, out
    assert devices and {torch.device(d) for d in devices} == {policy_throughput.run_device()}


def test_gemm_lower_bound_times_its_matmuls_on_the_given_device(monkeypatch):
    seen = []
    matmul = torch.matmul

    def recording_matmul(a, b):
        seen.append({a.device, b.device})
        return matmul(a, b)

    monkeypatch.setattr(torch, "matmul", recording_matmul)
    gemms = {"rollout": [policy_throughput.Gemm(64, 64, 256)], "scoring": [policy_throughput.Gemm(16, 64, 128, 2, 4)]}
    flops, seconds, _ = policy_throughput.lower_bound(gemms, 2, torch.device("meta"))
    assert seen and set().union(*seen) == {torch.device("meta")}
    assert flops == {"rollout": 2 * 64 * 64 * 256, "scoring": 2 * 2 * 4 * 16 * 64 * 128}
    assert all(s > 0 for s in seconds.values())

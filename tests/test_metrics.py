"""The metrics glossary: docs/metrics.md shows it as rendered, it names exactly what tiny runs of the scripts log."""

import dataclasses

import numpy as np
import pytest

import train_policy
import train_reward
from lm_human_preference_details import tracking
from lm_human_preference_details.instruments.metrics import (
    GLOSSARY,
    GLOSSARY_DOC,
    glossary_block,
    glossary_names,
    render_glossary,
)
from lm_human_preference_details.labels import save_labels
from lm_human_preference_details.settings import with_run
from tests.planted import REPO, books_task
from tests.test_train_policy import save_reward_model, tiny_args, tiny_task

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def logged_names(monkeypatch) -> set[str]:
    """Every scalar and table name the Tracker is asked to log while the test runs."""
    names: set[str] = set()
    log, log_table = tracking.Tracker.log, tracking.Tracker.log_table

    def record(self, metrics, step):
        names.update(metrics)
        return log(self, metrics, step)

    def record_table(self, key, columns, rows, step):
        names.add(key)
        return log_table(self, key, columns, rows, step)

    monkeypatch.setattr(tracking.Tracker, "log", record)
    monkeypatch.setattr(tracking.Tracker, "log_table", record_table)
    return names


def names_when(condition: str) -> set[str]:
    """The glossary's names logged only under `condition`."""
    return {name for metric in GLOSSARY if metric.when == condition for name in metric.names}


def test_docs_glossary_is_the_rendered_glossary():
    page = (REPO / GLOSSARY_DOC).read_text(encoding="utf-8")
    assert glossary_block(page) == render_glossary(), (
        f"run: python -m lm_human_preference_details.instruments.metrics --write {GLOSSARY_DOC}"
    )


def test_glossary_rows_are_complete_and_names_unique():
    names = [name for metric in GLOSSARY for name in metric.names]
    assert len(names) == len(set(names))
    for metric in GLOSSARY:
        assert metric.script in ("policy", "reward", "both") and metric.formula and metric.healthy, metric


def test_train_policy_logs_exactly_the_glossary_names(tmp_path, tiny_model_dir, query_file, logged_names):  # noqa: F811
    rm_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(query_file))
    args = tiny_args(tmp_path / "policy", tiny_model_dir, rm_dir, query_file, total_episodes=8)
    args.rewards.gold_model = "vader"  # the optional objective/gold_score
    train_policy.main(args)
    assert logged_names == glossary_names("policy")


def test_train_reward_logs_exactly_the_glossary_names(tmp_path, tiny_model_dir, tokenizer, logged_names):
    rng = np.random.default_rng(0)
    rows = [
        {
            "query": rng.integers(100, 5000, 6).tolist(),
            **{f"sample{i}": rng.integers(100, 5000, 4).tolist() for i in range(4)},
            "best": int(rng.integers(4)),
        }
        for _ in range(24)
    ]
    save_labels(str(tmp_path / "labels.json"), rows)
    (tmp_path / "queries.txt").write_text("The old man walked down the road.\nShe opened the window.\n" * 8)
    args = train_reward.Args(
        base_model=tiny_model_dir,
        label_dataset=str(tmp_path / "labels.json"),
        task=books_task(query_dataset=str(tmp_path / "queries.txt"), query_length=6, response_length=4),
        labels=train_reward.LabelHParams(num_train=16),  # 8 rows held out: eval/*
        batch_size=8,
        rollout_batch_size=8,
        normalize_samples=8,
        debug_normalize=8,
    )
    args = with_run(args, output_dir=str(tmp_path / "rm"))
    scalar_only = names_when("--labels.type scalar_rating")
    train_reward.main(args)
    assert logged_names == glossary_names("reward") - scalar_only
    logged_names.clear()
    args.run.overwrite_output_dir = True  # the runs below reuse the output directory
    train_reward.main(dataclasses.replace(args, normalize_before=False, normalize_after=False))
    normalize = {name for name in glossary_names("reward") if name.startswith("normalize_")}
    assert logged_names == glossary_names("reward") - scalar_only - normalize
    # scalar_rating labels: OAI's extra statistics, no best-of-N accuracy
    rating_rows = [{"query": row["query"], "sample": row["sample0"], "score": row["best"] / 3} for row in rows]
    save_labels(str(tmp_path / "rating.json"), rating_rows)
    logged_names.clear()
    labels = train_reward.LabelHParams(type="scalar_rating", num_train=16)
    train_reward.main(dataclasses.replace(args, label_dataset=str(tmp_path / "rating.json"), labels=labels))
    best_of_n_only = names_when("--labels.type best_of_N") | names_when(
        "--labels.type best_of_N and rows after num_train"
    )
    assert logged_names == glossary_names("reward") - best_of_n_only

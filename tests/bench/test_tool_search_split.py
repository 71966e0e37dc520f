"""The fixed LiveMCPBench split the tool-search rankers were chosen on (tuning) and are
measured on (heldout): its integrity, and that it is the documented seeded shuffle."""

import json
import random

import pytest

from once.bench.agent_bench.search import SPLIT_FILE, load_split, split_tasks


@pytest.fixture(scope="module")
def split_file():
    return json.loads(SPLIT_FILE.read_text(encoding="utf-8"))


def test_the_parts_are_disjoint_halves_of_94_distinct_ids(split_file):
    tuning, heldout = split_file["tuning"], split_file["heldout"]
    assert len(tuning) == len(heldout) == 47
    assert len(set(tuning)) == 47 and len(set(heldout)) == 47
    assert not set(tuning) & set(heldout)
    assert tuning == sorted(tuning) and heldout == sorted(heldout)
    assert not set(split_file["excluded"]) & (set(tuning) | set(heldout))
    assert load_split() == {"tuning": tuning, "heldout": heldout}


def test_the_split_is_the_seeded_shuffle_it_says(split_file):
    ids = sorted(split_file["tuning"] + split_file["heldout"])
    random.Random(split_file["seed"]).shuffle(ids)
    assert sorted(ids[: len(ids) // 2]) == split_file["tuning"]


def test_the_parts_cover_exactly_the_usable_tasks():
    from once.bench.agent_bench.search import default_data_dir, load_specs, load_tasks

    data_dir = default_data_dir()
    if not (data_dir / "livemcpbench").is_dir():
        pytest.skip(f"no tool_retrieval data at {data_dir} (set ONCE_SHARED_DATA)")
    specs = load_specs(data_dir)
    tasks = load_tasks(data_dir, {s.name for s in specs if s.namespace != "github"})
    split = load_split()
    assert {t.task_id for t in tasks} == set(split["tuning"]) | set(split["heldout"])
    parts = split_tasks(tasks, split)
    assert [len(parts["tuning"]), len(parts["heldout"])] == [47, 47]

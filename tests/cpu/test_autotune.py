"""AutoTuner on gloo ranks: all ranks agree on the SM count; profiles are saved, reloaded and applied."""

import json

import pytest

from tokenyard import env
from tokenyard.errors import InvalidInputError
from tokenyard.tools import autotune

PROBLEM = dict(hidden_size=128, num_tokens=16, num_experts=8, num_topk=2, sm_counts=[8, 16])


def _tune_save_and_load(profile_dir, seed):
    """On every rank: tune, save two entries, reload each, build a tuned buffer; -> what each step gave."""
    from tokenyard import AutoTuner, Buffer

    before = Buffer.num_sms
    try:
        tuner = AutoTuner(iters=2, warmup=0, profile_dir=profile_dir, seed=seed, quiet=tuner_quiet())
        chosen = tuner.tune_sm_count(**PROBLEM)
        unchanged = Buffer.num_sms == before
        entry = tuner.tune_and_save_profile("tiny", **PROBLEM)
        tuner.tune_and_save_profile("tiny", **dict(PROBLEM, hidden_size=256))
        missing = (tuner.load_profile("no_such_profile"), tuner.load_profile("tiny", hidden_size=512))
        try:
            tuner.load_profile("tiny")
            ambiguous = None
        except InvalidInputError as exc:
            ambiguous = str(exc)
        Buffer.num_sms = 2  # something no entry holds, so loading visibly applies
        loaded = tuner.load_profile("tiny", hidden_size=128, dtype="bf16")
        applied = Buffer.num_sms
        buffer = tuner.create_optimized_buffer(128, 16, 8, num_topk=2, sm_counts=[8, 16])
        sized = (buffer.backend, buffer.num_nvl_bytes, Buffer.num_sms == tuner.last_tuning["num_sms"])
        buffer.destroy()
        return {"chosen": chosen, "unchanged": unchanged, "saved": entry["num_sms"], "missing": missing,
                "ambiguous": ambiguous, "loaded": loaded, "applied": applied, "profile": tuner.profile,
                "sized": sized}
    finally:
        Buffer.num_sms = before


def tuner_quiet():
    """Rank 0 shows its progress bar (the path a user sees); the others are quiet anyway."""
    return False


def test_sm_choice_is_the_fewest_sms_within_tolerance_of_the_fastest():
    assert autotune.choose_sm_count({8: 900.0, 16: 610.0, 24: 600.0}) == 16
    assert autotune.choose_sm_count({8: 900.0, 16: 700.0, 24: 600.0}) == 24
    assert autotune.choose_sm_count({8: 600.0, 16: 900.0}, tolerance=0.0) == 8


def test_tuning_on_two_ranks_agrees_saves_a_readable_profile_and_loading_applies_it(ranks, seed, tmp_path):
    results = ranks(2).run(_tune_save_and_load, str(tmp_path), seed)
    first = results[0]
    for rank, r in enumerate(results):
        for field in ("chosen", "saved", "applied", "profile"):
            assert r[field] == first[field], f"rank {rank} disagrees on {field}: {r[field]} vs {first[field]}"
    assert first["unchanged"], "tune_sm_count must leave Buffer.num_sms alone"
    assert first["missing"] == (False, False)
    assert "pass hidden_size and dtype" in first["ambiguous"]
    assert first["loaded"] is True and first["applied"] == first["saved"] == first["profile"]["num_sms"]
    backend, num_nvl_bytes, applied = first["sized"]
    assert backend == "reference" and applied
    assert num_nvl_bytes == autotune.Config(num_max_tokens_per_rank=16).get_nvl_buffer_size_hint(256, 2)

    doc = json.loads((tmp_path / "tiny.json").read_text())
    assert doc["format"] == autotune.PROFILE_FORMAT and doc["name"] == "tiny"
    key = "cpu | 2 ranks | hidden 128 | dispatch bf16 | combine bf16"
    assert set(doc["entries"]) == {key, key.replace("hidden 128", "hidden 256")}
    entry = doc["entries"][key]
    assert {"device", "num_ranks", "hidden_size", "dispatch_dtype", "combine_dtype", "num_sms", "backend",
            "num_tokens", "num_experts", "num_topk", "measurements", "saved"} <= set(entry)
    assert (entry["device"], entry["num_ranks"], entry["hidden_size"], entry["backend"]) == ("cpu", 2, 128,
                                                                                            "reference")
    assert [m["num_sms"] for m in entry["measurements"]] == [8, 16]
    assert all(m["total_us"] > 0 for m in entry["measurements"])
    # The saved choice is choose_sm_count's rule applied to the times saved with it (on CPU the SM count means
    # nothing, so either count may win; the rule must be what picked it).
    times = {m["num_sms"]: m["total_us"] for m in entry["measurements"]}
    assert entry["num_sms"] == autotune.choose_sm_count(times, entry["tolerance"]), (entry["num_sms"], times)


def _bad_calls():
    from tokenyard import AutoTuner

    tuner = AutoTuner(iters=1, warmup=0, quiet=True)
    reasons = []
    for call in (lambda: tuner.tune_sm_count(128, 16, 7, num_topk=2, sm_counts=[8]),
                 lambda: tuner.tune_sm_count(128, 16, 8, num_topk=2, sm_counts=[7]),
                 lambda: tuner.load_profile("../escape")):
        try:
            call()
            reasons.append(None)
        except InvalidInputError as exc:
            reasons.append(str(exc))
    return reasons


def test_bad_problems_and_names_raise_on_every_rank(ranks):
    for reasons in ranks(2).run(_bad_calls):
        assert "not divisible" in reasons[0] and "even" in reasons[1] and "profile name" in reasons[2]


def test_profile_dir_comes_from_the_environment_table(tokenyard_env, tmp_path):
    assert env.Settings().profile_dir.endswith("profiles")
    tokenyard_env("TOKENYARD_PROFILE_DIR", str(tmp_path))
    assert env.settings().profile_dir == str(tmp_path)
    with pytest.raises(InvalidInputError, match="init_process_group"):
        autotune.AutoTuner()

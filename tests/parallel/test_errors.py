"""Clear start-up errors: heads not divisible by the TP size, a rank that never joins,
ranks serving different models."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from llmserve.launcher.cluster import free_port
from llmserve.worker.distributed import DistInit, GroupHandle, ParallelState, RendezvousError, init_parallel
from llmserve.worker.models.llama import LlamaForCausalLM


def _config(**kw):
    base = dict(hidden_size=36, intermediate_size=64, num_hidden_layers=2, num_attention_heads=9,
                num_key_value_heads=3, vocab_size=50, max_position_embeddings=64, rms_norm_eps=1e-5,
                hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return SimpleNamespace(**{**base, **kw})


def test_heads_not_divisible_by_tp_size():
    parallel = ParallelState(tp=GroupHandle.detached(2, 0))
    with pytest.raises(ValueError, match=r"^Total number of attention heads \(9\) must be divisible by "
                                         r"tensor parallel size \(2\)$"):
        LlamaForCausalLM(_config(), parallel)
    with pytest.raises(ValueError, match=r"KV heads \(3\) must be divisible by tensor parallel size \(2\)"):
        LlamaForCausalLM(_config(num_attention_heads=6, hidden_size=36), parallel)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="2 layers cannot be split across 3 pipeline stages"):
        LlamaForCausalLM(_config(num_attention_heads=4, num_key_value_heads=2),
                         ParallelState(pp=GroupHandle.detached(3, 0)))


def test_rank_that_never_joins_is_named():
    # World of 3, only rank 0 starts: it hosts the store and reports ranks 1 and 2 missing.
    cfg = DistInit(tp_size=3, pp_size=1, rank=0, init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=1.0)
    with pytest.raises(RendezvousError, match=r"waiting for rank\(s\) \[1, 2\] of 3 to join"):
        init_parallel(cfg)


def test_mismatched_model_paths_between_ranks():
    port = free_port()
    errors: dict[int, Exception] = {}

    def rank(r: int, path: str) -> None:
        try:
            init_parallel(DistInit(2, 1, r, f"tcp://127.0.0.1:{port}", timeout_s=20),
                          payload={"model_path": path}, agree_on=("model_path",))
        except Exception as err:  # noqa: BLE001
            errors[r] = err

    threads = [threading.Thread(target=rank, args=(r, p)) for r, p in ((0, "/models/a"), (1, "/models/b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(errors) == {0, 1}
    for err in errors.values():
        assert isinstance(err, RendezvousError)
        assert "ranks disagree on model_path: rank 0: '/models/a', rank 1: '/models/b'" in str(err)


def test_dist_init_from_flags_or_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "29500")
    cfg = DistInit.from_env(2, 2)
    assert (cfg.rank, cfg.world_size, cfg.address()) == (3, 4, ("10.0.0.5", 29500))
    flags = DistInit.from_env(2, 2, rank=1, init_method="tcp://host-a:1234")
    assert (flags.rank, flags.address()) == (1, ("host-a", 1234))
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="WORLD_SIZE=8 but --tp-size 2 x --pp-size 2 = 4"):
        DistInit.from_env(2, 2)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        DistInit(2, 1, 0, "env://").address()


def test_grid_layout():
    from llmserve.worker.distributed import grid_groups, stage_layer_range

    assert grid_groups(2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert [stage_layer_range(30, 4, s) for s in range(4)] == [(0, 7), (7, 15), (15, 22), (22, 30)]

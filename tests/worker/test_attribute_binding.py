"""A served model's submodules, parameters and buffers are plain attributes: a step's
reads skip Module.__getattr__, and the binding follows the registries."""

from __future__ import annotations

import collections

import torch
from torch import nn

from llmserve.worker.config import RunnerConfig
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.models.attribute_binding import bind_registered_attributes

from .conftest import PlanDriver


def test_a_runner_step_reads_no_attribute_through_module_getattr(tiny_llama_dir, monkeypatch):
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=4, num_kv_blocks=40, max_model_len=64,
                                                      swap_space=0))
    driver = PlanDriver(runner, 4, 40)
    driver.add("a", [11, 45, 3, 99, 120])
    driver.step({"a": None})
    misses = collections.Counter()
    original = nn.Module.__getattr__

    def counting(self, name):
        misses[f"{type(self).__name__}.{name}"] += 1
        return original(self, name)

    monkeypatch.setattr(nn.Module, "__getattr__", counting)
    for _ in range(3):
        driver.step({"a": 1})
    assert len(driver.outputs("a")) == 4
    assert not misses, misses.most_common(5)


class _Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2), requires_grad=False)
        self.register_buffer("table", torch.zeros(2), persistent=False)
        self.register_parameter("bias", None)


class _Tree(nn.Module):
    def __init__(self):
        super().__init__()
        self.leaf = _Leaf()
        self.extra = _Leaf()


def test_binding_follows_assignments_and_rebinding():
    tree = _Tree()
    assert bind_registered_attributes(tree) == 2 + 2 * 3
    assert vars(tree)["leaf"] is tree._modules["leaf"] and vars(tree.leaf)["weight"] is tree.leaf._parameters["weight"]

    # Module.__setattr__ drops the cached entry when a Module or Parameter is assigned.
    replacement = _Leaf()
    tree.leaf = replacement
    assert tree.leaf is replacement
    weight = nn.Parameter(torch.full((2,), 3.0), requires_grad=False)
    tree.extra.weight = weight
    assert tree.extra.weight is weight

    # A new buffer tensor, and a name deleted, leave stale entries until rebound.
    table = torch.ones(2)
    tree.extra.table = table
    assert tree.extra.table is not table
    del tree.extra
    bind_registered_attributes(tree)
    assert tree.leaf.table is not table and "extra" not in vars(tree)
    replacement.table = table
    bind_registered_attributes(tree)
    assert tree.leaf.table is table

"""The CPU facts every CPU-keyed cache and report reads (llmserve/kernels/cpu/host.py)."""

from __future__ import annotations

from llmserve.kernels.cpu.host import cpu_facts, parse_cpuinfo

TWO_PROCESSORS = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni

processor\t: 1
model name\t: Some Other CPU
flags\t\t: fpu amx_tile
"""


def test_the_first_processor_is_read_field_by_field():
    facts = parse_cpuinfo(TWO_PROCESSORS)
    assert facts.model_name == "AMD EPYC" and (facts.family, facts.model) == ("26", "2")
    assert facts.flags == {"fpu", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}


def test_the_key_changes_with_the_instruction_sets_not_with_their_order():
    facts = parse_cpuinfo(TWO_PROCESSORS)
    reordered = parse_cpuinfo(TWO_PROCESSORS.replace("avx512_bf16 avx512_vnni", "avx512_vnni avx512_bf16"))
    without_bf16 = parse_cpuinfo(TWO_PROCESSORS.replace(" avx512_bf16", ""))
    assert facts.key == reordered.key != without_bf16.key


def test_without_cpuinfo_no_flags_are_claimed():
    facts = parse_cpuinfo("")
    assert facts.flags == frozenset() and facts.family is None and facts.model_name


def test_this_machine_reads_its_own_cpuinfo():
    # Every Linux CPU this suite runs on lists its flags (x86's include fpu, Arm's fp).
    assert cpu_facts().flags & {"fpu", "fp"}


def test_the_last_level_cache_is_the_largest_listed(tmp_path):
    from llmserve.kernels.cpu.host import last_level_cache_bytes

    for index, size in enumerate(["48K", "2048K", "300M"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 300 * 2**20
    assert last_level_cache_bytes(tmp_path / "absent") == 32 * 2**20  # sysfs silent: a typical size

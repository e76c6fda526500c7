"""kernels/tuning.py: the prefetch levels are measured once per CPU, cached, forced by the environment, and never
change a result."""

import json

import pytest
import torch

from nodeserve.kernels import native, tuning

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the native kernels could not be built (no C compiler?)")


@pytest.fixture
def restore_levels():
    before = kernels.prefetch
    yield
    tuning.apply(kernels, before)


def test_a_measured_choice_is_cached_with_its_cpu_and_read_back(tmp_path, monkeypatch, restore_levels):
    monkeypatch.delenv("NODESERVE_KERNELS_PREFETCH", raising=False)
    path = str(tmp_path / "k.prefetch.json")
    gemv = (lambda: native._gemv_workload(kernels)) if kernels.r16 else None  # as native.load() times it
    measured = tuning.choose(kernels, path, gemv)
    assert measured.source == "measured" and measured.cpu == tuning.cpu_identity()
    saved = json.loads(open(path).read())
    assert (saved["pages_l2"], saved["weights_l2"], saved["cpu"]) == (measured.pages_l2, measured.weights_l2,
                                                                       measured.cpu)
    again = tuning.choose(kernels, path)
    assert again.source == "cached" and (again.pages_l2, again.weights_l2) == (measured.pages_l2,
                                                                                measured.weights_l2)


def test_a_choice_cached_on_another_cpu_is_measured_again(tmp_path, monkeypatch, restore_levels):
    monkeypatch.delenv("NODESERVE_KERNELS_PREFETCH", raising=False)
    path = tmp_path / "k.prefetch.json"
    other = tuning.cpu_identity().replace(" / ", " / 999", 2)  # this CPU's vendor, another family and model
    path.write_text(json.dumps({"pages_l2": False, "weights_l2": False, "source": "measured", "cpu": other}))
    assert other != tuning.cpu_identity()
    assert tuning.choose(kernels, str(path)).source == "measured"
    assert json.loads(path.read_text())["cpu"] == tuning.cpu_identity()


def test_a_broken_cache_file_is_measured_again(tmp_path, monkeypatch, restore_levels):
    monkeypatch.delenv("NODESERVE_KERNELS_PREFETCH", raising=False)
    path = tmp_path / "k.prefetch.json"
    path.write_text("{half a file")
    assert tuning.choose(kernels, str(path)).source == "measured"


@pytest.mark.parametrize("forced", ["l1", "L2"])
def test_the_environment_forces_both_levels_and_nothing_is_written(tmp_path, monkeypatch, restore_levels, forced):
    monkeypatch.setenv("NODESERVE_KERNELS_PREFETCH", forced)
    path = tmp_path / "k.prefetch.json"
    levels = tuning.choose(kernels, str(path))
    l2 = forced.lower() == "l2"
    assert (levels.pages_l2, levels.weights_l2, levels.source) == (l2, l2, "forced") and not path.exists()
    assert levels.describe() == f"prefetch: pages into {'L2' if l2 else 'L1'}, weights into {'L2' if l2 else 'L1'} " \
                                "(forced)"


def test_a_wrong_forced_level_is_refused(monkeypatch):
    monkeypatch.setenv("NODESERVE_KERNELS_PREFETCH", "l3")
    with pytest.raises(ValueError, match="NODESERVE_KERNELS_PREFETCH must be l1 or l2"):
        tuning.choose(kernels, None)


def test_the_levels_change_no_result(restore_levels):
    """Attention over scattered pages and a repacked GEMV give the same bits with prefetches into L1 or L2."""
    torch.manual_seed(0)
    kv = torch.randn(64, 2, 16, 3, 64)
    tables = torch.randperm(64).view(4, 16)
    q, seq_lens = torch.randn(4, 9, 64), torch.tensor([256, 200, 17, 1])
    n, k = 64, 256
    raw = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8)
    raw[..., 0:4] = torch.tensor([0x00, 0x20, 0x00, 0x00], dtype=torch.uint8)
    qtype, weights = native.Q4_1, raw.reshape(n, -1)
    if kernels.r16:
        weights = kernels.repack(native.Q4_1, weights, n, k)
        qtype |= native.R16 | native.R16_FLAGS[kernels.r16_kernels[0]]
    x = torch.randn(3, k)
    outs = []
    for l2 in (False, True):
        tuning.apply(kernels, tuning.PrefetchLevels(l2, l2, "forced"))
        outs.append((kernels.paged_decode_attention(q, kv, tables, seq_lens, 0.125), kernels.linear(qtype, weights, x, n)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_a_build_for_a_cpu_this_one_is_not_is_never_timed(tmp_path, monkeypatch):
    """Loading a build only to inspect it (test_native's Alder Lake build) must run none of its code here."""
    monkeypatch.delenv("NODESERVE_KERNELS_PREFETCH", raising=False)

    class Foreign:
        features = frozenset({"avx2", "some_extension_no_cpu_has"})

        @property
        def lib(self):
            raise AssertionError("a foreign build was called")

    path = tmp_path / "k.prefetch.json"
    levels = tuning.choose(Foreign(), str(path))  # type: ignore[arg-type]
    assert levels.source == "default, built for another CPU" and not path.exists()
    assert tuning.runs_here(kernels.features)

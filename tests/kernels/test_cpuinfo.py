"""kernels/cpuinfo.py: the first processor's block only, x86 and Arm flags, no file."""

from nodeserve.kernels import cpuinfo


def test_only_the_first_processors_fields_count(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
                    "flags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nvendor_id\t: Other\nflags\t\t: avx512f\n\n")
    fields = cpuinfo.first_processor(str(path))
    assert cpuinfo.identity(fields) == "AuthenticAMD / 25 / 1 / AMD EPYC"
    assert cpuinfo.isa_flags(fields) == frozenset({"fpu", "avx2", "fma"})


def test_arm_features_and_no_file(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n\n")
    assert cpuinfo.isa_flags(cpuinfo.first_processor(str(path))) == frozenset({"fp", "asimd", "sve"})
    assert cpuinfo.first_processor(str(tmp_path / "none")) == {}
    assert cpuinfo.isa_flags({}) is None and cpuinfo.identity({}) == "? / ? / ? / ?"

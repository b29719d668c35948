"""The instruction-set levels the native kernels are built for, best first.

Read by ``setup.py`` (which compiles every kernel once per level of the machine's
architecture, at install time) and by :mod:`training.objectives.native` (which loads, at run
time, the best level this CPU supports). Plain data, no imports, so that ``setup.py`` can read
it without importing the package.

Each entry: (name, the compiler's flags, the CPU flags of ``/proc/cpuinfo`` the level needs).
The x86-64 levels are the psABI's micro-architecture levels (x86-64-v4: AVX-512 F/BW/CD/DQ/VL;
v3: AVX2, FMA, BMI1/2, F16C, MOVBE, LZCNT; the baseline: SSE2), tuned for no CPU in particular.
"""

X86_64 = [
    (
        "x86_64_v4",
        ["-march=x86-64-v4", "-mtune=generic"],
        ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"],
    ),
    (
        "x86_64_v3",
        ["-march=x86-64-v3", "-mtune=generic"],
        ["avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"],
    ),
    ("x86_64", ["-march=x86-64", "-mtune=generic"], []),
]
OTHER = [("generic", [], [])]  # any other architecture: the compiler's default target


def levels_for(machine: str) -> list[tuple[str, list[str], list[str]]]:
    """The levels built for a machine named as ``platform.machine()`` names it."""
    return X86_64 if machine.lower() in ("x86_64", "amd64") else OTHER


# (library, source stem, C defines): every library the kernels build, one per dtype flavour
LIBRARIES = [
    ("nca_candidates_f32", "nca_candidates", []),
    ("nca_candidates_f64", "nca_candidates", ["NCA_DOUBLE"]),
    ("knca_linear_f64", "knca_linear", []),
    ("nca_exact_rows_f32", "nca_exact_rows", []),
]

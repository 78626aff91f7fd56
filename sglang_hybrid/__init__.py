"""sglang-hybrid: an SGLang plugin serving KDA + sparse-MLA hybrid models.

Kept import-light on purpose: cpu_support is imported at interpreter start in
every SGLang process on CPU hosts.
"""

__version__ = "0.1.0"

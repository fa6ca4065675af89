"""What a process of SpecECD's own loads with transformers, and what it leaves out.

:func:`skip_unused_imports` marks the process as SpecECD's own (the command line and the
bench's workers call it); :func:`lean_transformers`, run by :mod:`spececd.backends.hf`
before it imports transformers, then leaves out what none of SpecECD's code uses. A user's
process that uses the Python API is left as it is. Nothing here imports a model runtime.
"""

from __future__ import annotations

import importlib.metadata
import sys

_SKIP_UNUSED = False  # set by skip_unused_imports: this process is SpecECD's own


def skip_unused_imports() -> None:
    """Say that this process is SpecECD's own (the command line's, a bench worker's), so
    that transformers, when a model needs it (:func:`lean_transformers`, run as
    :mod:`spececd.backends.hf` loads), skips what none of its code uses."""
    global _SKIP_UNUSED
    _SKIP_UNUSED = True


def lean_transformers() -> None:
    """In a process of SpecECD's own, before transformers loads, two imports that no
    causal LM's code uses are left out, where neither they nor the modules that make them
    have loaded:
    - SciPy, which transformers' modeling utilities import wherever it is installed, for
      the matching in its object-detection losses: 0.7 s of every command's start on a
      2-core CPU;
    - before transformers 5.21, scikit-learn (with SciPy and pandas), which its generation
      utilities import for the confidence threshold of its own assisted generation (run
      only by the bench's assisted baseline, whose worker does not call
      :func:`skip_unused_imports`): 1.8 s. 5.21 and later import it only where used.

    transformers is told each is absent. Elsewhere (the Python API in a user's process)
    nothing changes."""
    if not _SKIP_UNUSED:
        return
    try:
        from packaging.version import Version

        old = Version(importlib.metadata.version("transformers")) < Version("5.21")
        import transformers.utils
    except Exception:  # no transformers, no packaging, a broken install: the import says
        return
    # (the package, transformers' check for it, the module that imports it when loaded,
    # whether that import applies to this version)
    for package, check, importer, applies in (
            ("scipy", "is_scipy_available", "transformers.loss.loss_for_object_detection",
             True),
            ("sklearn", "is_sklearn_available", "transformers.generation.candidate_generator",
             old)):
        if (applies and package not in sys.modules and importer not in sys.modules
                and hasattr(transformers.utils, check)):
            setattr(transformers.utils, check, lambda: False)

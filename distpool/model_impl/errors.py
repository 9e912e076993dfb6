"""What the model implementations refuse, as facts: which implementation, what it was given, why.
The command line turns them into sentences with its flags and the fix (`distpool.cli.errors`).
"""

from __future__ import annotations


class ImplCannotRun(ValueError):
    """Implementation `impl` ("reference", "transformers") cannot run the model at `source`:
    `reason` says why, in the model's terms (its architectures, layers, sizes)."""

    def __init__(self, impl: str, source: str, reason: str) -> None:
        super().__init__(reason)
        self.impl, self.source, self.reason = impl, source, reason

    def __reduce__(self):
        return type(self), (self.impl, self.source, self.reason)


class WeightOptionsUnused(ValueError):
    """A weights dtype or load format (`dtype`, `load_format`; "auto" when not given) for an
    implementation (`impl`: reference or synthetic) that loads no weights."""

    def __init__(self, impl: str, dtype: str, load_format: str) -> None:
        super().__init__(
            f"the {impl} implementation loads no weights; got dtype {dtype!r}, load format {load_format!r}"
        )
        self.impl, self.dtype, self.load_format = impl, dtype, load_format

    def __reduce__(self):
        return type(self), (self.impl, self.dtype, self.load_format)


class NoWeights(ValueError):
    """`folder` holds no safetensors weights beside its config.json for `load_format` to load."""

    def __init__(self, folder: str, load_format: str) -> None:
        super().__init__(f"{folder} holds no *.safetensors weights beside a config.json ({load_format})")
        self.folder, self.load_format = folder, load_format

    def __reduce__(self):
        return type(self), (self.folder, self.load_format)


class CheckpointDtypeUnsupported(ValueError):
    """The checkpoint is stored in `dtype`, which the transformers runner does not compute in;
    `supported`: the dtypes it does."""

    def __init__(self, dtype: str, supported: tuple[str, ...]) -> None:
        computes = ", ".join(supported)
        super().__init__(f"the checkpoint is stored in {dtype}; the runner computes in {computes}")
        self.dtype, self.supported = dtype, supported

    def __reduce__(self):
        return type(self), (self.dtype, self.supported)

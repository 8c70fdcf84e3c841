# Types of datadist._core, the native core built from cpp/python/*.cc (CMakeLists.txt,
# docs/native-build.md). Private: datadist.core.native_build says whether it is built.

__version__: str

def build_info() -> dict[str, str]: ...

# The process's transfer metrics, kept by the core (cpp/src/metrics.h); read by
# datadist.core.metrics. Each series: (op, cluster_id, transfers, bytes, {status name: count},
# per-bucket counts (not cumulative; the last above all), nanoseconds summed).
def metrics_series() -> list[tuple[str, int, int, int, dict[str, int], list[int], int]]: ...
def metrics_reset() -> None: ...
def metrics_record(op: str, cluster_id: int, nbytes: int, seconds: float, code: int) -> None: ...

# The option table (cpp/src/options.h): both APIs' one parser of the init options. Read by
# datadist.core.native (option_table, parse_options, check_option), LLMConfig's extras and
# `datadist info`. Every call returns at once; a bad value raises
# datadist.core.errors.InvalidArgument (LLM_PARAM_INVALID) with the table's message.
class OptionSpec:
    @property
    def key(self) -> str: ...
    @property
    def env(self) -> str: ...
    @property
    def kind(self) -> str: ...  # "bool", "int", "enum", "str", "path" or "secret"
    @property
    def values(self) -> list[str]: ...  # an enum's accepted values
    @property
    def range(self) -> tuple[int, int] | None: ...  # an int's, both ends included
    @property
    def unit(self) -> str: ...
    @property
    def default(self) -> str: ...
    @property
    def attr(self) -> str: ...  # the LLMConfig property made for it, "" for none
    @property
    def doc(self) -> str: ...

def options() -> list[OptionSpec]: ...
# {key: (value, source)} for every row; source: "option", "env" or "default".
def parse_options(options: dict[str, str], *, environ: bool = True
                  ) -> dict[str, tuple[bool | int | str, str]]: ...
def check_option(key: str, value: str) -> bool | int | str: ...
# What a forced transport means for links: local_channel, shm, shm_forced, nixl_read.
def transport_settings(transport: str) -> dict[str, bool]: ...

# Every error of the core is raised as datadist.core.errors' class for its code (the binding's
# one code-to-class table, cpp/python/module.cc PyError); a checksum mismatch as IntegrityError.

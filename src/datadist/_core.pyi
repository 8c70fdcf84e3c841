# Types of datadist._core, the native core built from cpp/python/*.cc (CMakeLists.txt,
# docs/native-build.md). Private: datadist.core.native_build says whether it is built.

__version__: str

def build_info() -> dict[str, str]: ...

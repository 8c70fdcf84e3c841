"""docs/porting.md's claims that the code can answer (issue 38 item 14): the options it calls
ignored are LLMConfig settings that init accepts in cache-manager mode, the C++ options it says
the engine reads are read, and the pages it links exist."""

from __future__ import annotations

import re
from pathlib import Path

import datadist as llm

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "porting.md").read_text()
IGNORED = {"link_retry_count": 3, "rdma_traffic_class": 100, "rdma_service_level": 3,
           "global_resource_config": "{}", "mem_utilization": 0.9, "deploy_res_path": "/x",
           "output_max_size": 1024}


def _row(item: str) -> str:
    return next(line for line in PAGE.splitlines() if line.startswith(f"| {item}"))


def test_the_ignored_options_are_accepted_and_change_no_mode() -> None:
    row = _row("HCCL / RDMA / GE options")
    assert "ignored" in row
    for name in [*IGNORED, "cluster_info"]:
        assert f"`{name}`" in row, name
    cfg = llm.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    for name, value in IGNORED.items():
        setattr(cfg, name, value)
    dd = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
    dd.init(cfg.generate_options())
    try:
        assert dd.cache_manager is not None
    finally:
        dd.finalize()


def test_the_cpp_options_it_names_are_read_by_the_engine() -> None:
    source = (ROOT / "cpp" / "src" / "llm_datadist.cc").read_text()
    table = (ROOT / "cpp" / "src" / "options.cc").read_text()  # the core's option table
    header = (ROOT / "cpp" / "include" / "llm_datadist" / "llm_datadist.h").read_text()
    keys = dict(re.findall(r'(OPTION_[A-Z_]+)\[\] = "([^"]+)"', header))
    named = re.findall(r"`(OPTION_[A-Z_]+)`", _row("C++ options"))
    assert len(named) >= 4
    for option in named:
        assert (f"Find(options, {option})" in source
                or f'"{keys.get(option, option)}"' in table), option


def test_the_pages_it_links_exist() -> None:
    for page in re.findall(r"\]\(([a-z-]+\.md)\)", PAGE):
        assert (ROOT / "docs" / page).is_file(), page

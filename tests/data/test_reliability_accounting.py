"""`verify` checks the record accounting of a pretokenized folder strictly enough that an edit of the counts, also
one kept consistent with the other counts, is caught: every record read became a document or was skipped, the
documents are the distinct doc_ids in the shards, the skipped list holds the first min(100, skipped), and the
inputs' records add up. Before, `verify` only required documents + skipped <= records."""

from __future__ import annotations

import json

import pytest

from balancer.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("acct")
    lines = [json.dumps({"text": f"record {i} " * (3 + i % 5)}) for i in range(30)]
    lines[7] = "{not json"
    (root / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "tok"
    assert main(["pretokenize", str(root / "in.jsonl"), "--output", str(out), "--on-error", "skip"]) == 0
    return out


def _edited(folder, tmp_path, edit):
    import shutil

    copy = tmp_path / "tok"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return copy


def _more_records(m):  # five more records read, also in the input's count: nothing else says where they went
    m["counts"]["records"] += 5
    m["inputs"][0]["records"] += 5


def _more_skipped(m):  # ... and counted as skipped: the list of skipped records does not hold them
    _more_records(m)
    m["counts"]["skipped"]["bad_json"] += 5


def _fewer_documents(m):  # one document fewer, one record fewer: the shards still hold every doc_id
    m["counts"]["documents"] -= 1
    m["counts"]["records"] -= 1
    m["inputs"][0]["records"] -= 1


def _skipped_elsewhere(m):  # the skipped record moved beyond the records read
    m["skipped_records"][0]["doc_id"] = 10_000


def _inputs_only(m):
    m["inputs"][0]["records"] += 1


@pytest.mark.parametrize(
    "edit, says",
    [
        (_more_records, "documents 29 + skipped 1 != records read 35"),
        (_more_skipped, "skipped_records lists 1 records, but 6 were skipped"),
        (_fewer_documents, "counts.documents is 28, but the shards hold 29 distinct doc_ids"),
        (_skipped_elsewhere, "skipped_records names doc_id 10000, outside the records read"),
        (_inputs_only, "the inputs hold 31 records, counts say 30"),
    ],
)
def test_verify_catches_consistent_edits_of_the_record_counts(folder, tmp_path, capsys, edit, says):
    assert main(["verify", str(folder)]) == 0
    capsys.readouterr()
    assert main(["verify", str(_edited(folder, tmp_path, edit))]) == 1
    out = capsys.readouterr()
    assert "record accounting: " + says in out.out + out.err

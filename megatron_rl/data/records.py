"""One prompt record, checked and normalized: {"id", "prompt", "answer", "metadata"}.

A raw record (a JSONL object or a parquet row) names its prompt, label and metadata by the fields that
--input-key, --label-key and --metadata-key give. The prompt is a string or an OpenAI-style message list
([{"role": "system" | "user" | "assistant", "content": str}, ...]); the label is a string; the metadata, when
--metadata-key is given, is an object. The id is the record's own "id" field (a string or an integer) if it has
one, else its index in the file. Every error names where the record is (file and line or row) and the field.
"""

from __future__ import annotations

import dataclasses

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class RecordFields:
    """Which raw fields hold the prompt, the label and the metadata (--input-key, --label-key, --metadata-key)."""

    input_key: str = "prompt"
    label_key: str = "answer"
    metadata_key: str | None = None

    def columns(self) -> list[str]:
        return [self.input_key, self.label_key] + ([self.metadata_key] if self.metadata_key else [])


def normalize(raw, where: str, index: int, fields: RecordFields) -> dict:
    """The record {"id", "prompt", "answer", "metadata"} of `raw`, the record at `where` (index `index`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(raw).__name__}")
    prompt = _field(raw, fields.input_key, where)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: field {fields.input_key!r} is empty")
    elif isinstance(prompt, list):
        check_messages(prompt, f"{where}: field {fields.input_key!r}")
    else:
        raise ValueError(f"{where}: field {fields.input_key!r} must be a string or a list of messages, got "
                         f"{type(prompt).__name__}")
    answer = _field(raw, fields.label_key, where)
    if not isinstance(answer, str):
        raise ValueError(f"{where}: field {fields.label_key!r} must be a string, got {type(answer).__name__}")
    metadata = {}
    if fields.metadata_key:
        metadata = _field(raw, fields.metadata_key, where)
        if not isinstance(metadata, dict):
            raise ValueError(f"{where}: field {fields.metadata_key!r} must be an object, got "
                             f"{type(metadata).__name__}")
    record_id = raw.get("id")
    if record_id is None:
        record_id = index
    elif isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
        raise ValueError(f"{where}: field 'id' must be a string or an integer, got {type(record_id).__name__}")
    return {"id": str(record_id), "prompt": prompt, "answer": answer, "metadata": metadata}


def check_messages(messages: list, where: str) -> None:
    """An OpenAI-style chat: a non-empty list of {"role", "content"} objects, roles system/user/assistant/tool."""
    if not messages:
        raise ValueError(f"{where}: the message list is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}[{i}]: a message must be an object with 'role' and 'content', got "
                             f"{type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}[{i}].role: must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"{where}[{i}].content: must be a string, got {type(content).__name__}")


def _field(raw: dict, name: str, where: str):
    if name not in raw:
        raise ValueError(f"{where}: field {name!r} is missing")
    if raw[name] is None:
        raise ValueError(f"{where}: field {name!r} is null")
    return raw[name]

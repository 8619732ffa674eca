"""Calibration text for causal LMs: any dataset's fields as the ``prompt`` / ``response`` pairs the family encodes."""

from __future__ import annotations

from typing import Optional, Sequence, Union


def prompt_response(rows, prompt: Union[str, Sequence[str]], response: str):
    """A ``datasets.Dataset`` of ``prompt`` / ``response`` strings from ``rows``' fields: ``prompt`` names one field
    or several, joined by a blank line with empty ones left out (Alpaca's instruction and input). The first prompt
    field and ``response`` are required; the others are optional, read as empty where a dataset lacks them (as
    MergeBench's code reads Alpaca's ``input`` only where present)."""
    fields = [prompt] if isinstance(prompt, str) else list(prompt)
    if not fields:
        raise ValueError("prompt names no field")
    missing = [f for f in (fields[0], response) if f not in rows.column_names]
    if missing:
        raise ValueError(f"the calibration dataset has no field(s) {missing}; it has {rows.column_names}")
    fields = [f for f in fields if f in rows.column_names]

    def convert(row):
        parts = [str(row[f]).strip() for f in fields if row[f] is not None and str(row[f]).strip()]
        return {"prompt": "\n\n".join(parts), "response": str(row[response])}

    return rows.map(convert, remove_columns=rows.column_names)


def load_prompt_response(path: str, prompt: Union[str, Sequence[str]], response: str, split: str = "train",
                         name: Optional[str] = None, **kwargs):
    """``datasets.load_dataset(path, name, split=split)`` (a hub name, or a local builder such as ``json`` with
    ``data_files``) as prompt / response pairs."""
    from datasets import load_dataset

    return prompt_response(load_dataset(path, name, split=split, **kwargs), prompt, response)

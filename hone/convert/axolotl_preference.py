"""Axolotl's preference configs (``rl: dpo | ipo | orpo``) -> hone's preference objective
(``training.objective``, ``training.preference``) and ``preference`` datasets.

Pure functions on the parsed mapping, like :mod:`hone.convert.axolotl`, which calls them: each
takes the keys it translates out of a plain dict (so a key nobody took is reported there) and
returns what it made, the keys it could not carry over with the reason, and notes.

Axolotl hands its rows to TRL's trainers after one of its prompt strategies
(``src/axolotl/prompt_strategies/{dpo,orpo}``) rewrote them. A strategy maps only where hone's
``preference`` type reads the same rows into the same token sequences: message lists rendered by
a chat template, or text fields used as they are (TRL's own formats, ``passthrough``). The
``chatml.*`` / ``llama3.*`` strategies that wrap *text* fields in hard-coded chat turns
(``intel``, ``icr``, ``prompt_pairs``, ``argilla``, ``default``) have no such reading: hone's text
pairs are not templated, so the entry is left out with how to rewrite its rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: ``rl`` values hone trains, and the objective each becomes.
OBJECTIVES: dict[str, str] = {"dpo": "dpo", "ipo": "ipo", "orpo": "orpo"}

#: Dataset types that map, for the messages shown when one does not.
ACCEPTED_TYPES = (
    "chat_template / chat_template.default",
    "chat_template.argilla_chat",
    "chat_template.argilla (ORPO)",
    "chatml.argilla_chat",
    "chatml.ultra",
    "llama3.argilla_chat",
    "llama3.ultra",
    "passthrough",
    "a user_defined mapping with the plain {prompt}/{chosen}/{rejected} formats",
)

#: The strategies that wrap text fields in hard-coded chat turns, and the template they write.
_TEXT_IN_TURNS = {"chatml": "chatml", "llama3": "llama3"}
_TEXT_STRATEGIES = ("default", "argilla", "intel", "icr", "prompt_pairs")

#: Axolotl keys of TRL's DPO/ORPO trainers that hone has no counterpart for.
_NO_COUNTERPART: dict[str, str] = {
    "dpo_use_weighting": "hone's DPO has no WPO weighting of the pairs",
    "dpo_loss_weights": "hone trains one preference loss (training.objective), not a weighted mix",
    "rpo_alpha": "hone's DPO adds no NLL term (ORPO has one: training.objective: orpo)",
    "dpo_norm_loss": "hone's DPO sums each completion's log-probabilities (as TRL does)",
    "max_prompt_len": "hone cuts pairs by data.sequence_len and data.excess_length_strategy (the prompt is never cut)",
    "max_prompt_length": "hone cuts pairs by data.sequence_len and data.excess_length_strategy (the prompt is never cut)",
    "simpo_gamma": "SimPO is not one of hone's objectives",
    "cpo_alpha": "CPO/SimPO is not one of hone's objectives",
    "kto_desirable_weight": "KTO is not one of hone's objectives",
    "kto_undesirable_weight": "KTO is not one of hone's objectives",
}

#: Keys hone does not need: it does the same thing on its own.
_NOT_NEEDED: dict[str, str] = {
    "dpo_padding_free": "hone always packs a micro-batch's pairs into one row without padding",
    "dpo_use_liger_kernel": "hone's log-probabilities come from its chunked fused path (no [tokens x vocab] logits)",
}


@dataclass
class Translated:
    """What one translation made (``values``), the keys it lost (``(key, reason)``) and notes."""

    values: dict[str, Any] = field(default_factory=dict)
    lost: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _asks_nothing(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _loss_types(raw: Mapping[str, Any]) -> list[str]:
    value = raw.get("dpo_loss_type")
    if _asks_nothing(value):
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def rl_refusal(raw: Mapping[str, Any]) -> str | None:
    """Why hone cannot train this config's ``rl`` objective (``key: value: why``); None when it can
    (no ``rl``, or DPO / IPO / ORPO with a loss hone has)."""
    rl = raw.get("rl")
    if _asks_nothing(rl):
        return None
    supported = ", ".join(OBJECTIVES)
    if str(rl) not in OBJECTIVES:
        return (
            f"rl: {rl}: hone's preference objectives are {supported} (training.objective); '{rl}' is not one of "
            "them, and converting would train another objective on the same rows"
        )
    losses = _loss_types(raw)
    if str(rl) == "dpo" and losses and losses not in (["sigmoid"], ["ipo"]):
        return (
            f"dpo_loss_type: {losses}: hone's DPO losses are sigmoid (training.objective: dpo) and ipo "
            "(training.objective: ipo), one at a time"
        )
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def objective(left: dict[str, Any]) -> Translated:
    """``rl`` and its keys -> ``{"objective": ..., "preference": {...}}`` for the training section.

    Takes the keys out of ``left`` (the top-level Axolotl keys not translated yet). Call only
    after :func:`rl_refusal` found nothing to refuse.
    """
    out = Translated()
    rl = str(left.pop("rl"))
    losses = _loss_types(left)
    left.pop("dpo_loss_type", None)
    name = "ipo" if rl == "ipo" or losses == ["ipo"] else OBJECTIVES[rl]
    out.values["objective"] = name
    if rl == "dpo" and name == "ipo":
        out.notes.append("rl: dpo with dpo_loss_type: [ipo] -> training.objective: ipo")
    preference: dict[str, Any] = {}
    _beta(left, rl, preference, out)
    smoothing = left.pop("dpo_label_smoothing", None)
    if not _asks_nothing(smoothing):
        if name != "dpo":
            out.lost.append(("dpo_label_smoothing", f"label smoothing applies to DPO only (Axolotl ignores it for {name})"))
        elif _number(smoothing) is None:
            out.lost.append(("dpo_label_smoothing", f"{smoothing!r} is not a number"))
        else:
            preference["label_smoothing"] = _number(smoothing)
    precompute = left.pop("precompute_ref_log_probs", None)
    if precompute is True and name != "orpo":
        preference["reference"] = "precomputed"
        out.notes.append(
            "precompute_ref_log_probs: true -> training.preference.reference: precomputed (computed once before "
            "the first step; hone's default under LoRA is the adapter switched off in the same step)"
        )
    elif precompute is True:
        out.lost.append(("precompute_ref_log_probs", "ORPO has no reference model"))
    for key, reason in _NO_COUNTERPART.items():
        if not _asks_nothing(left.pop(key, None)):
            out.lost.append((key, reason))
    for key, reason in _NOT_NEEDED.items():
        if not _asks_nothing(left.pop(key, None)):
            out.notes.append(f"{key}: not needed ({reason})")
    if preference:
        out.values["preference"] = preference
    return out


def _beta(left: dict[str, Any], rl: str, preference: dict[str, Any], out: Translated) -> None:
    """Axolotl's beta, in its order: ``trl.beta``, ``rl_beta`` (``dpo_beta`` before it), then
    ``orpo_alpha`` (which TRL's ORPOConfig calls beta: the weight of the odds-ratio term)."""
    trl = left.pop("trl", None)
    trl = dict(trl) if isinstance(trl, Mapping) else {}
    candidates = [
        ("trl.beta", trl.pop("beta", None)),
        ("rl_beta", left.pop("rl_beta", None)),
        ("dpo_beta", left.pop("dpo_beta", None)),
        ("orpo_alpha", left.pop("orpo_alpha", None)),
    ]
    for key, value in trl.items():
        if not _asks_nothing(value):
            out.lost.append((f"trl.{key}", "only trl.beta maps (training.preference.beta)"))
    chosen = next(((key, value) for key, value in candidates if value is not None), None)
    if chosen is None:
        return
    key, value = chosen
    beta = _number(value)
    if beta is None:
        out.lost.append((key, f"{value!r} is not a number"))
        return
    preference["beta"] = beta
    if key == "orpo_alpha" and rl != "orpo":
        out.notes.append(f"orpo_alpha -> training.preference.beta for rl: {rl} (Axolotl passes it to TRL's beta)")
    elif key == "orpo_alpha":
        out.notes.append("orpo_alpha -> training.preference.beta (the weight of ORPO's odds-ratio term, TRL's ORPO beta)")
    for other, value in candidates:
        if other != key and value is not None:
            out.lost.append((other, f"{key} is set and wins (Axolotl's order: trl.beta, rl_beta, orpo_alpha)"))


def _message_fields(ds: dict[str, Any], fields: dict[str, Any], out: Translated, prefix: str) -> None:
    """``message_property_mappings`` (or the legacy ``message_field_*``) and ``roles`` -> hone's
    field_role / field_content / role_map."""
    mapping = dict(ds.pop("message_property_mappings", None) or {})
    role = mapping.pop("role", None) or ds.pop("message_field_role", None) or "role"
    content = mapping.pop("content", None) or ds.pop("message_field_content", None) or "content"
    if mapping:
        out.lost.append((f"{prefix}message_property_mappings", f"only role and content map; not {', '.join(mapping)}"))
    if role != "role":
        fields["field_role"] = str(role)
    if content != "content":
        fields["field_content"] = str(content)
    roles = ds.pop("roles", None)
    if isinstance(roles, Mapping):
        role_map = {
            str(source): str(standard)
            for standard, sources in roles.items()
            for source in (sources if isinstance(sources, list) else [sources])
            if source != standard
        }
        if role_map:
            fields["role_map"] = role_map


def _rewrite_hint(template: str) -> str:
    return (
        "hone's text pairs are used as they are (not wrapped in chat turns) and its chat pairs are message lists: "
        'write each row as {"prompt": [{"role": "system", ...}, {"role": "user", "content": <the question>}], '
        '"chosen": [{"role": "assistant", "content": <chosen>}], "rejected": [...]} and use '
        f"type: preference with data.chat_template: {template}"
    )


def preference_dataset(kind: Any, ds: dict[str, Any], prefix: str) -> Translated | str:
    """One dataset entry's ``type`` and its keys (taken out of ``ds``) -> hone's ``preference``
    entry fields in ``values`` (with ``chat_template``: the template name the type implies);
    or, where hone cannot read the rows the same way, the reason the entry is left out."""
    out = Translated()
    fields: dict[str, Any] = {"type": "preference"}
    if isinstance(kind, Mapping):
        return _user_defined(dict(kind), fields, out, prefix)
    name = str(kind) if kind is not None else "chat_template"
    if "." not in name:
        name += ".default"  # Axolotl's loader: a bare module name is its default strategy
    module, strategy = name.rsplit(".", 1)
    if name == "passthrough.default":
        pass  # TRL's own formats: prompt / chosen / rejected as text or messages, which hone reads
    elif module == "chat_template" and strategy == "default":
        fields["field_prompt"] = str(ds.pop("field_messages", None) or "messages")
        _completion_fields(ds, fields)
        _message_fields(ds, fields, out, prefix)
        out.notes.append(
            f"{prefix}type: {name} -> preference: the {fields['field_prompt']} column is the prompt's messages; "
            "hone reads chosen/rejected as lists of the messages that follow it (Axolotl also takes one message "
            "or a string, and trains only the last message)"
        )
    elif module == "chat_template" and strategy in ("argilla_chat", "argilla"):
        fields["field_prompt"] = None  # the shared turns of chosen/rejected are the prompt
        _completion_fields(ds, fields)
        _message_fields(ds, fields, out, prefix)
        if strategy == "argilla":  # ORPO's: reads an optional system and prompt column too
            _system_note(name, prefix, out)
    elif module in _TEXT_IN_TURNS and strategy in ("argilla_chat", "ultra"):
        fields["field_prompt"] = None
        out.values["chat_template"] = _TEXT_IN_TURNS[module]
        if strategy == "ultra":  # reads an optional system column and the prompt column too
            _system_note(name, prefix, out)
    elif module in _TEXT_IN_TURNS and strategy in _TEXT_STRATEGIES:
        return (
            f"type {name!r} wraps text fields in {module} turns: {_rewrite_hint(_TEXT_IN_TURNS[module])}; the entry is left out"
        )
    else:
        return (
            f"type {name!r} has no hone counterpart for preference data (hone maps: {'; '.join(ACCEPTED_TYPES)}); "
            "the entry is left out"
        )
    out.values.update(fields)
    return out


def _completion_fields(ds: dict[str, Any], fields: dict[str, Any]) -> None:
    for key in ("field_chosen", "field_rejected"):
        value = ds.pop(key, None)
        if value and value != key.removeprefix("field_"):
            fields[key] = str(value)


def _system_note(name: str, prefix: str, out: Translated) -> None:
    out.notes.append(
        f"{prefix}type: {name} -> preference with the prompt taken from the turns chosen and rejected share "
        "(field_prompt: null); a separate system or prompt column is not read"
    )


def _user_defined(spec: dict[str, Any], fields: dict[str, Any], out: Translated, prefix: str) -> Translated | str:
    """A ``type:`` mapping (Axolotl's ``user_defined.default``): text fields through format
    strings. Only the plain formats read the rows as hone's text pairs do."""
    plain = {"prompt_format": "{prompt}", "chosen_format": "{chosen}", "rejected_format": "{rejected}"}
    formats = {key: spec.pop(key, None) or default for key, default in plain.items()}
    if formats != plain:
        changed = ", ".join(f"{key}: {formats[key]!r}" for key in plain if formats[key] != plain[key])
        return (
            f"a user_defined type with {changed}: hone's text pairs are the fields as they are (the prompt gets "
            "the tokenizer's BOS, each completion its EOS); write the formatted texts into the rows, or use "
            "chat messages, and keep the plain {prompt}/{chosen}/{rejected} formats; the entry is left out"
        )
    spec.pop("field_system", None)  # read only through a {system} placeholder, which the plain format lacks
    for key in ("field_prompt", "field_chosen", "field_rejected"):
        value = spec.pop(key, None)
        if value and value != key.removeprefix("field_"):
            fields[key] = str(value)
    for key, value in spec.items():
        if not _asks_nothing(value):
            out.lost.append((f"{prefix}type.{key}", "not a user_defined key hone knows how to translate"))
    out.values.update(fields)
    return out

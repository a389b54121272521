"""Parameter-efficient adapters (LoRA through PEFT) or a full fine-tune."""

from typing import Any, Literal

from pydantic import Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer, model_validator

from hone.config.base import Section

_LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_rslora")


class AdapterConfig(Section):
    """LoRA through PEFT, or ``none`` for a full fine-tune. ``adapter: lora`` is shorthand for ``adapter: {type: lora}``."""

    type: Literal["lora", "none"] = "lora"
    """``lora`` trains low-rank adapters through PEFT; ``none`` trains every weight."""

    lora_r: int = Field(16, gt=0)
    """LoRA rank."""

    lora_alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator: updates are scaled by alpha / r (alpha / sqrt(r) with rslora)."""

    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter input."""

    lora_target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Module names (suffix match, as in PEFT) that get adapters, or ``all-linear``."""

    use_rslora: bool = False
    """Rank-stabilised LoRA scaling (alpha / sqrt(r))."""

    lora_modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained in full beside the adapter and saved with it (e.g. ``lm_head``)."""

    @model_validator(mode="before")
    @classmethod
    def _accept_shorthand(cls, value: Any) -> Any:
        """``adapter: lora`` / ``adapter: none`` is shorthand for ``adapter: {type: ...}``."""
        if isinstance(value, str):
            return {"type": value}
        return value

    @model_validator(mode="after")
    def _lora_keys_need_lora(self) -> "AdapterConfig":
        if self.type == "none":
            stray = [k for k in (*_LORA_KEYS, "lora_modules_to_save") if self.explicitly_set(k)]
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} only apply to adapter.type 'lora' but adapter.type is "
                    "'none' (full fine-tune): remove them or set adapter.type: lora"
                )
        if isinstance(self.lora_target_modules, list) and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty: name modules or use 'all-linear'")
        return self

    @model_serializer(mode="wrap")
    def _drop_lora_keys_without_lora(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """A full fine-tune's resolved config omits the LoRA keys, so it loads back as written."""
        data = handler(self)
        if self.type == "none":
            for key in (*_LORA_KEYS, "lora_modules_to_save"):
                data.pop(key, None)
        return data

    @property
    def is_lora(self) -> bool:
        return self.type == "lora"

    @property
    def scaling(self) -> float:
        """The factor PEFT multiplies the low-rank update by."""
        return self.lora_alpha / (self.lora_r**0.5 if self.use_rslora else self.lora_r)

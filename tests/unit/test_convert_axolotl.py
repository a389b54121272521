"""``hone convert``: Axolotl configs shaped like the ones Axolotl documents (written here) convert,
validate with hone's own loader, and list exactly the keys they could not translate."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hone.cli import main
from hone.config import load_config
from hone.convert.axolotl import convert_axolotl, render_conversion

LLAMA_LORA = """
base_model: NousResearch/Meta-Llama-3.1-8B
model_type: LlamaForCausalLM
tokenizer_type: AutoTokenizer
load_in_8bit: true
load_in_4bit: false
datasets:
  - path: data/alpaca_2k.jsonl
    type: alpaca
dataset_prepared_path: last_run_prepared
val_set_size: 0.05
output_dir: ./outputs/lora-out
sequence_len: 4096
sample_packing: true
eval_sample_packing: false
pad_to_sequence_len: true
adapter: lora
lora_model_dir:
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
wandb_project:
wandb_entity:
gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 4
optimizer: adamw_bnb_8bit
lr_scheduler: cosine
learning_rate: 2e-4
train_on_inputs: false
bf16: auto
tf32: false
gradient_checkpointing: true
resume_from_checkpoint:
logging_steps: 1
flash_attention: true
warmup_steps: 10
evals_per_epoch: 4
saves_per_epoch: 1
weight_decay: 0.0
special_tokens:
  pad_token: "<|end_of_text|>"
"""

LLAMA_QLORA = """
base_model: NousResearch/Llama-3.2-1B
load_in_4bit: true
strict: false
datasets:
  - path: teknium/GPT4-LLM-Cleaned
    type: alpaca
val_set_size: 0.1
output_dir: ./outputs/qlora-out
adapter: qlora
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules: [gate_proj, down_proj, up_proj, q_proj, v_proj, k_proj, o_proj]
sequence_len: 2048
sample_packing: true
gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 1
optimizer: paged_adamw_8bit
lr_scheduler: cosine
learning_rate: 0.0002
bf16: auto
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
flash_attention: true
loss_watchdog_threshold: 5.0
loss_watchdog_patience: 3
warmup_steps: 10
evals_per_epoch: 4
eval_steps: 20
saves_per_epoch: 1
weight_decay: 0.0
special_tokens:
  pad_token: "<|end_of_text|>"
"""

LLAMA_FULL_FSDP = """
base_model: meta-llama/Llama-3.1-8B
datasets:
  - path: tatsu-lab/alpaca
    type: alpaca
output_dir: ./outputs/full-fft
sequence_len: 8192
sample_packing: true
gradient_accumulation_steps: 1
micro_batch_size: 1
num_epochs: 1
optimizer: adamw_torch_fused
lr_scheduler: cosine
learning_rate: 2e-5
bf16: auto
tf32: false
gradient_checkpointing: true
logging_steps: 1
flash_attention: true
warmup_steps: 100
saves_per_epoch: 1
weight_decay: 0.0
fsdp_version: 2
fsdp_config:
  offload_params: false
  state_dict_type: FULL_STATE_DICT
  auto_wrap_policy: TRANSFORMER_BASED_WRAP
  transformer_layer_cls_to_wrap: LlamaDecoderLayer
  reshard_after_forward: true
special_tokens:
  pad_token: <|finetune_right_pad_id|>
"""

QWEN3_CHAT = """
base_model: Qwen/Qwen3-8B
chat_template: qwen3
datasets:
  - path: data/chats.jsonl
    type: chat_template
    field_messages: messages
    message_property_mappings:
      role: role
      content: content
    roles_to_train: [assistant]
    train_on_eos: turn
val_set_size: 0.0
output_dir: ./outputs/qwen3-lora
dataset_prepared_path: last_run_prepared
sequence_len: 2048
sample_packing: true
adapter: lora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
lora_target_modules: [q_proj, k_proj, v_proj, o_proj, down_proj, up_proj]
lora_mlp_kernel: true
lora_qkv_kernel: true
lora_o_kernel: true
gradient_accumulation_steps: 2
micro_batch_size: 1
num_epochs: 1
optimizer: adamw_torch_fused
lr_scheduler: cosine
learning_rate: 0.0002
bf16: auto
tf32: true
gradient_checkpointing: offload
activation_offloading: true
flash_attention: true
warmup_ratio: 0.1
evals_per_epoch: 4
saves_per_epoch: 1
weight_decay: 0.0
"""

QWEN3_COMPILE = """
base_model: /models/Qwen3-4B
datasets:
  - path: data/pairs.jsonl
    type: chat_template
    field_messages: conversation
    message_property_mappings:
      role: speaker
      content: text
    roles:
      user: [human, user]
      assistant: [gpt, assistant]
chat_template: chatml
output_dir: ./outputs/qwen3-compile
sequence_len: 4096
sample_packing: true
adapter: lora
lora_r: 8
lora_alpha: 16
lora_target_linear: true
micro_batch_size: 4
gradient_accumulation_steps: 1
max_steps: 500
num_epochs: 3
optimizer: adamw_torch
lr_scheduler: linear
learning_rate: 1e-4
max_grad_norm: 0.5
bf16: true
sdp_attention: true
torch_compile: true
torch_compile_backend: inductor
torch_compile_mode: reduce-overhead
gradient_checkpointing: false
seed: 1234
save_steps: 100
logging_steps: 10
liger_fused_linear_cross_entropy: true
liger_rms_norm: true
plugins:
  - axolotl.integrations.liger.LigerPlugin
"""

MISTRAL_LORA = """
base_model: mistralai/Mistral-7B-v0.1
model_type: MistralForCausalLM
tokenizer_type: LlamaTokenizer
is_mistral_derived_model: true
datasets:
  - path: data/sharegpt.json
    type: sharegpt
    conversation: chatml
val_set_size: 0.02
output_dir: ./outputs/mistral-lora
adapter: lora
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
sequence_len: 8192
sample_packing: false
pad_to_sequence_len: true
gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 2
optimizer: adamw_torch
lr_scheduler: cosine
learning_rate: 0.000005
fp16: true
gradient_checkpointing: true
xformers_attention: true
warmup_steps: 10
eval_steps: 50
save_steps: 100
resume_from_checkpoint: ./outputs/mistral-lora/checkpoint-100
wandb_project: mistral-ft
wandb_log_model: checkpoint
deepspeed: deepspeed_configs/zero2.json
"""

MIXTRAL_QLORA = """
base_model: mistralai/Mixtral-8x7B-v0.1
trust_remote_code: true
load_in_4bit: true
datasets:
  - path: data/oasst.jsonl
    type: chat_template
    field_messages: conversations
    message_field_role: from
    message_field_content: value
    roles_to_train: [assistant]
chat_template: tokenizer_default
val_set_size: 0.0
output_dir: ./outputs/mixtral-qlora
adapter: qlora
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules: [q_proj, k_proj, v_proj, o_proj, w1, w2, w3]
sequence_len: 4096
sample_packing: true
gradient_accumulation_steps: 4
micro_batch_size: 1
num_epochs: 1
optimizer: adamw_bnb_8bit
lr_scheduler: cosine
learning_rate: 0.0002
bf16: auto
gradient_checkpointing: true
flash_attention: true
warmup_steps: 10
eval_steps: 10
deepspeed: deepspeed_configs/zero3_bf16_cpuoffload_params.json
"""

QWEN3_MOE = """
base_model: Qwen/Qwen3-30B-A3B
plugins:
  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin
cut_cross_entropy: true
datasets:
  - path: json
    data_files: data/moe_chats.jsonl
    type: chat_template
    split: train
chat_template: jinja
chat_template_jinja: "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
test_datasets:
  - path: data/moe_eval.jsonl
    type: chat_template
output_dir: ./outputs/qwen3-moe
sequence_len: 2048
sample_packing: true
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_modules: [q_proj, k_proj, v_proj, o_proj]
micro_batch_size: 1
gradient_accumulation_steps: 8
num_epochs: 1
optimizer: adamw_torch_fused
lr_scheduler: constant_with_warmup
learning_rate: 1e-4
bf16: true
flex_attention: true
torch_compile: true
gradient_checkpointing: true
warmup_steps: 20
eval_steps: 25
fsdp:
  - full_shard
  - auto_wrap
fsdp_config:
  fsdp_offload_params: true
  fsdp_sync_module_states: true
  fsdp_use_orig_params: false
  fsdp_transformer_layer_cls_to_wrap: Qwen3MoeDecoderLayer
  fsdp_state_dict_type: SHARDED_STATE_DICT
hub_model_id: me/qwen3-moe-lora
"""

COMPLETION_FULL = """
base_model: ./models/tiny-base
datasets:
  - path: data/corpus.parquet
    type: completion
    field: body
  - path: data/wiki.jsonl
    type: completion
dataset_processes: 4
val_set_size: 0.01
output_dir: ./outputs/pretrain
sequence_len: 1024
sample_packing: true
micro_batch_size: 8
gradient_accumulation_steps: 2
num_epochs: 1
optimizer: lion_8bit
lr_scheduler: rex
learning_rate: 3e-5
adam_beta2: 0.95
bf16: false
tf32: true
eager_attention: true
logging_steps: 5
eval_steps: 200
save_total_limit: 3
group_by_length: true
"""

ALPACA_MIXED = """
base_model: meta-llama/Llama-3.2-3B-Instruct
tokenizer_config: ./tokenizers/llama32-chat
datasets:
  - path: data/alpaca_clean.jsonl
    type: alpaca
  - path: vicgalle/alpaca-gpt4
    type: alpaca
    split: train[:20%]
  - path: data/custom.jsonl
    type:
      field_instruction: question
      field_output: answer
      format: "[INST] {instruction} [/INST]"
      no_input_format: "[INST] {instruction} [/INST]"
  - path: data/dpo.jsonl
    type: chatml.intel
val_set_size: 0.05
output_dir: ./outputs/alpaca-mix
adapter: lora
lora_r: 64
lora_alpha: 128
lora_dropout: 0.1
lora_target_modules: [q_proj, v_proj]
lora_modules_to_save: [embed_tokens, lm_head]
peft_use_rslora: true
sequence_len: 2048
micro_batch_size: 2
gradient_accumulation_steps: 8
num_epochs: 3
learning_rate: 0.0001
lr_scheduler: cosine
cosine_min_lr_ratio: 0.1
warmup_ratio: 0.03
optimizer: adamw_torch
weight_decay: 0.01
max_grad_norm: 1.0
bf16: true
sdp_attention: true
gradient_checkpointing: true
neftune_noise_alpha: 5
early_stopping_patience: 3
train_on_inputs: true
tokens: ["<|custom|>"]
"""

# name -> (Axolotl YAML, the keys listed as not translated)
CASES: dict[str, tuple[str, set[str]]] = {
    "llama-lora": (
        LLAMA_LORA,
        {"load_in_8bit", "special_tokens"},
    ),
    "llama-qlora": (
        LLAMA_QLORA,
        {"evals_per_epoch", "loss_watchdog_threshold", "loss_watchdog_patience", "special_tokens"},
    ),
    "llama-full-fsdp": (
        LLAMA_FULL_FSDP,
        {"special_tokens", "fsdp_config.state_dict_type"},
    ),
    "qwen3-chat": (
        QWEN3_CHAT,
        {"datasets[0].train_on_eos", "evals_per_epoch"},
    ),
    "qwen3-compile": (
        QWEN3_COMPILE,
        {"num_epochs", "liger_rms_norm"},
    ),
    "mistral-lora": (
        MISTRAL_LORA,
        {"datasets[0].conversation", "xformers_attention", "wandb_log_model", "deepspeed"},
    ),
    "mixtral-qlora": (
        MIXTRAL_QLORA,
        {"eval_steps"},
    ),
    "qwen3-moe": (
        QWEN3_MOE,
        {"datasets[0].split", "fsdp_config.fsdp_state_dict_type", "hub_model_id"},
    ),
    "completion-full": (
        COMPLETION_FULL,
        {"optimizer", "lr_scheduler", "group_by_length"},
    ),
    "alpaca-mixed": (
        ALPACA_MIXED,
        {
            "datasets[1].split",
            "datasets[2]",
            "datasets[3]",
            "neftune_noise_alpha",
            "early_stopping_patience",
            "train_on_inputs",
            "tokens",
        },
    ),
}


def converted(text: str):
    return convert_axolotl(yaml.safe_load(text))


@pytest.mark.parametrize("name", sorted(CASES))
def test_converts_validates_and_lists_untranslated(name, tmp_path):
    text, expected = CASES[name]
    conversion = converted(text)
    assert sorted(conversion.untranslated_keys) == sorted(expected)
    assert all(u.reason for u in conversion.untranslated)
    out = tmp_path / "hone.yml"
    out.write_text(render_conversion(conversion, f"{name}.yml"))
    cfg = load_config(out)  # hone's own loader
    assert cfg.model.path is not None
    header = out.read_text().split("\n\n", 1)[0]
    for key in expected:  # the comment block names every untranslated key
        assert f"#   {key}: " in header


def test_llama_lora_values():
    cfg = converted(LLAMA_LORA).config
    assert cfg["model"] == {
        "path": "NousResearch/Meta-Llama-3.1-8B",
        "dtype": "bfloat16",
        **({"attn_implementation": "flash_attention_2"} if "attn_implementation" in cfg["model"] else {}),
    }
    assert cfg["data"]["datasets"] == [{"path": "data/alpaca_2k.jsonl", "type": "alpaca"}]
    assert cfg["data"]["sequence_len"] == 4096 and cfg["data"]["sample_packing"] is True
    assert cfg["data"]["eval_sample_packing"] is False and cfg["data"]["val_set_size"] == 0.05
    assert cfg["data"]["dataset_prepared_path"] == "last_run_prepared"
    assert cfg["adapter"] == {
        "type": "lora",
        "lora_r": 32,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "lora_target_modules": "all-linear",
    }
    assert cfg["training"] == {
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "num_epochs": 4,
        "saves_per_epoch": 1,
        "evals_per_epoch": 4,
        "output_dir": "./outputs/lora-out",
    }
    assert cfg["optimizer"] == {
        "name": "adamw_8bit",
        "learning_rate": 2e-4,
        "weight_decay": 0.0,
        "lr_scheduler": "cosine",
        "warmup_steps": 10,
    }
    assert cfg["memory"] == {"activation_checkpointing": "full"}
    assert cfg["logging"] == {"logging_steps": 1}


def test_chat_template_fields_and_memory():
    conversion = converted(QWEN3_CHAT)
    cfg = conversion.config
    assert cfg["data"]["datasets"] == [{"path": "data/chats.jsonl", "type": "chat", "train_on": ["assistant"]}]
    assert "val_set_size" not in cfg["data"]
    assert cfg["memory"] == {"activation_checkpointing": "offload"}
    assert cfg["optimizer"]["warmup_ratio"] == 0.1
    assert any(note.startswith("lora_mlp_kernel") for note in conversion.notes)


def test_renamed_fields_roles_chatml_compile_and_fused_loss():
    cfg = converted(QWEN3_COMPILE).config
    (entry,) = cfg["data"]["datasets"]
    assert entry == {
        "path": "data/pairs.jsonl",
        "type": "chat",
        "field_messages": "conversation",
        "field_role": "speaker",
        "field_content": "text",
        "role_map": {"human": "user", "gpt": "assistant"},
    }
    assert cfg["data"]["chat_template"] == "chatml"  # a template hone ships, by name
    assert cfg["training"]["max_steps"] == 500 and "num_epochs" not in cfg["training"]
    assert cfg["training"]["max_grad_norm"] == 0.5 and cfg["training"]["seed"] == 1234
    # reduce-overhead (CUDA graphs) is kept with packing: every micro-batch takes one boundary count
    assert cfg["performance"] == {"torch_compile": True, "torch_compile_mode": "reduce-overhead", "loss": "fused_linear_ce"}
    assert cfg["optimizer"]["lr_scheduler"] == "linear"
    assert "memory" not in cfg


def test_a_cuda_graph_compile_mode_with_packing_through_flash_attention_is_kept(monkeypatch):
    from hone.convert import axolotl

    flash = QWEN3_COMPILE.replace("sdp_attention: true", "flash_attention: true")
    monkeypatch.setitem(axolotl.BACKENDS, "flash_attention_2", SimpleNamespace(installed=True))  # as if flash-attn were
    conversion = converted(flash)
    assert conversion.config["model"]["attn_implementation"] == "flash_attention_2"
    assert conversion.config["performance"]["torch_compile_mode"] == "reduce-overhead"
    assert "torch_compile_mode" not in conversion.untranslated_keys


def test_sharegpt_fp16_resume_and_zero2():
    cfg = converted(MISTRAL_LORA).config
    assert cfg["data"]["datasets"][0] == {
        "path": "data/sharegpt.json",
        "type": "chat",
        "field_messages": "conversations",
        "field_role": "from",
        "field_content": "value",
        "role_map": {"human": "user", "gpt": "assistant"},
    }
    assert cfg["model"]["dtype"] == "float16"
    assert cfg["training"]["resume"] == "./outputs/mistral-lora/checkpoint-100"
    assert cfg["training"]["eval_steps"] == 50
    assert "distributed" not in cfg  # ZeRO-2 has no hone equivalent: strategy stays auto


def test_moe_fsdp_data_files_jinja_and_test_datasets():
    conversion = converted(QWEN3_MOE)
    cfg = conversion.config
    assert cfg["data"]["datasets"] == [{"path": "data/moe_chats.jsonl", "type": "chat"}]
    assert cfg["data"]["test_datasets"] == [{"path": "data/moe_eval.jsonl", "type": "chat"}]
    assert cfg["data"]["chat_template"].startswith("{% for m in messages %}")
    assert cfg["distributed"] == {"strategy": "fsdp", "cpu_offload": True}
    assert cfg["model"]["attn_implementation"] == "flex_attention"
    assert cfg["performance"] == {"torch_compile": True, "loss": "fused_linear_ce"}
    assert cfg["optimizer"]["lr_scheduler"] == "constant"
    assert cfg["training"]["eval_steps"] == 25


def test_qlora_becomes_lora_and_zero3_becomes_fsdp():
    conversion = converted(MIXTRAL_QLORA)
    cfg = conversion.config
    assert cfg["adapter"]["type"] == "lora"
    assert cfg["adapter"]["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"]
    assert cfg["model"]["trust_remote_code"] is True
    assert cfg["distributed"] == {"strategy": "fsdp", "cpu_offload": True}
    assert "chat_template" not in cfg["data"]  # tokenizer_default is hone's default
    assert cfg["data"]["datasets"][0]["field_messages"] == "conversations"
    assert "quantize" not in cfg["model"]  # hone does not shard a 4-bit base: FSDP wins, said in a note
    assert any("qlora" in note and "does not shard a 4-bit" in note for note in conversion.notes)


def test_qlora_becomes_an_nf4_base():
    conversion = converted(LLAMA_QLORA)
    assert conversion.config["model"]["quantize"] == "nf4"
    assert conversion.config["adapter"]["type"] == "lora"
    assert any("model.quantize: nf4" in note for note in conversion.notes)
    fp4 = converted(LLAMA_QLORA + "bnb_config_kwargs: {bnb_4bit_quant_type: fp4}\n")
    assert fp4.config["model"]["quantize"] == "nf4"
    assert any(u.key == "bnb_config_kwargs" for u in fp4.untranslated)
    full = converted(LLAMA_QLORA.replace("adapter: qlora", "adapter:"))
    assert "quantize" not in full.config["model"] and any(u.key == "load_in_4bit" for u in full.untranslated)


def test_wandb_and_mlflow_keys_become_trackers(tmp_path):
    conversion = converted(
        LLAMA_LORA
        + """
wandb_project: my-proj
wandb_entity: me
wandb_name: run-1
wandb_mode: offline
wandb_watch: gradients
mlflow_tracking_uri: file:./mlruns
mlflow_experiment_name: exp
"""
    )
    logging = conversion.config["logging"]
    assert logging["trackers"] == ["tensorboard", "wandb", "mlflow"]
    assert logging["wandb"] == {"project": "my-proj", "entity": "me", "name": "run-1", "mode": "offline"}
    assert logging["mlflow"] == {"tracking_uri": "file:./mlruns", "experiment": "exp"}
    assert {u.key for u in conversion.untranslated} >= {"wandb_watch"}
    from hone.config import parse_config

    cfg = dict(conversion.config, training={**conversion.config.get("training", {}), "output_dir": str(tmp_path)})
    assert parse_config(cfg).logging.trackers == ["tensorboard", "wandb", "mlflow"]
    disabled = converted(LLAMA_LORA + "wandb_project: p\nwandb_mode: disabled\n")
    assert "trackers" not in disabled.config.get("logging", {})


def test_full_finetune_float32_completion_fields():
    cfg = converted(COMPLETION_FULL).config
    assert cfg["adapter"] == {"type": "none"}
    assert cfg["model"] == {"path": "./models/tiny-base", "dtype": "float32", "attn_implementation": "eager"}
    assert cfg["data"]["datasets"] == [
        {"path": "data/corpus.parquet", "type": "completion", "field_text": "body"},
        {"path": "data/wiki.jsonl", "type": "completion"},
    ]
    assert cfg["data"]["num_proc"] == 4
    assert cfg["optimizer"] == {"learning_rate": 3e-5, "adam_beta2": 0.95}
    assert cfg["training"]["save_total_limit"] == 3


def test_alpaca_mix_drops_unknown_types_and_keeps_lora_extras():
    cfg = converted(ALPACA_MIXED).config
    assert [d["path"] for d in cfg["data"]["datasets"]] == ["data/alpaca_clean.jsonl", "vicgalle/alpaca-gpt4"]
    assert cfg["model"]["tokenizer_path"] == "./tokenizers/llama32-chat"
    assert cfg["adapter"]["lora_modules_to_save"] == ["embed_tokens", "lm_head"] and cfg["adapter"]["use_rslora"] is True
    assert cfg["optimizer"]["cosine_min_lr_ratio"] == 0.1 and cfg["optimizer"]["warmup_ratio"] == 0.03


def test_unknown_key_is_listed():
    conversion = convert_axolotl({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "frobnicate": 3})
    assert conversion.untranslated_keys == ["frobnicate"]


# --- the command ---------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    source = tmp_path / "axolotl.yml"
    source.write_text(text)
    return source


def test_cli_writes_validates_and_refuses_overwrite(tmp_path, capsys):
    source = write(tmp_path, LLAMA_LORA)
    out = tmp_path / "hone.yml"
    assert main(["convert", str(source), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "valid" in printed and "load_in_8bit: hone's only quantized base" in printed
    assert out.read_text().startswith("# hone config converted from the Axolotl config")
    assert load_config(out).data.sequence_len == 4096
    out.write_text("keep me")
    assert main(["convert", str(source), "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_text() == "keep me"
    assert main(["convert", str(source), "-o", str(out), "--force"]) == 0
    assert load_config(out).adapter.lora_r == 32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_cli_exit_2_with_hones_error_when_result_is_invalid(tmp_path, capsys):
    source = write(tmp_path, "datasets:\n  - path: d.jsonl\n    type: alpaca\n")  # no base_model
    out = tmp_path / "hone.yml"
    assert main(["convert", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not validate" in err and "model.path" in err
    assert out.is_file()  # kept, for fixing by hand


def test_cli_bad_source(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope.yml"), "-o", str(tmp_path / "o.yml")]) == 2
    assert "not found" in capsys.readouterr().err
    source = write(tmp_path, "- a list\n")
    assert main(["convert", str(source), "-o", str(tmp_path / "o.yml")]) == 2
    assert "mapping" in capsys.readouterr().err

"""HF transformers interop in one room: the families (config and weight-name rules per model_type),
sharded safetensors weights read and written, the exported directory (tokenizer, README, config),
and the ``tessera convert`` commands (import, export, consolidation)."""

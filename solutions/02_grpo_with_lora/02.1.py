# EXERCISE 02.1
import torch.nn as nn

fresh_base, _ = load_model_and_tokenizer(model_dir)
rank = 4
lora_params_rank_4 = sum(rank * (layer.in_features + layer.out_features)
                         for name, layer in fresh_base.named_modules()
                         if isinstance(layer, nn.Linear) and name != "lm_head")
print(f"rank 4: {lora_params_rank_4:,} parameters; rank 1 (trained above): "
      f"{lora_trainer.num_trainable:,}; the model: "
      f"{sum(p.numel() for p in fresh_base.parameters()):,}")

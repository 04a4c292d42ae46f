"""Fine-tuning in the Hugging Face order: load a saved model, build the optimizer, THEN move the model to the GPU;
resume extra weights with torch.load(map_location="cuda") (a valid GPU script). Argument: the model directory."""
import sys

import torch
from transformers import AutoModelForCausalLM

model_dir = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model.to("cuda")
extra = torch.load(f"{model_dir}/extra.pt", map_location="cuda")
for step in range(5):
    ids = torch.randint(0, 100, (2, 16), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss + extra["bias"].sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

"""The model and its DeepSpeed engine: what turns batches into losses and updates.

Owns loading the model and tokenizer (:mod:`.model`: ``AutoModelFor*``, parameter groups,
``deepspeed.initialize``), the DeepSpeed config finetune writes (:mod:`.ds_config`: ZeRO stage, precision,
offload, batch sizes), LoRA adapters through peft (:mod:`.lora`), fused kernels (:mod:`.kernels`), which parameters
DeepSpeed's Muon trains (:mod:`.muon`) and what a mixture-of-experts model needs (:mod:`.moe`: ZeRO-3 leaf modules, the
router's load-balancing loss and statistics). It may import the parallel layout (sequence and tensor parallel wiring), the
run config, logging, finetune's patches of other libraries and errors; it never
imports the data pipeline, the recipes or the run's lifecycle.
"""

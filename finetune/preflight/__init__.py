"""Everything checked before any GPU time is spent.

Owns the validation of a run (:mod:`.validate`: config, files, columns, tokenizer, layout, resume; one clear
line per problem before any model is built), the memory and time planner (:mod:`.plan`) and the self-test of a
machine's GPU paths (:mod:`.selftest`). It may import everything below it (the lifecycle, the recipes, the
engine, the data pipeline, the parallel layout, the air-gap manifests and the base); only the commands and the
training loop's callers import it.
"""

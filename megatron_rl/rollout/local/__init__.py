"""The built-in rollout engine (the CPU default): SGLang's request semantics and runtime weight layout over a
TP group, in this process."""

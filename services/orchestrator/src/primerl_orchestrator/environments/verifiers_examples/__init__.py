"""Two verifiers environments shipped as examples of `kind = "verifiers"`, their datasets
built locally: `reasoning_gym_task` (a procedural reasoning-gym task, single turn, its
scorer as the rubric) and `key_value_store` (the model looks a value up with a tool, multi
turn). Each is a module with a `load_environment(**args)`, as any verifiers environment."""

"""openprime.train: the Llama model, data, schedule, loss, trainer and the `openprime` command."""

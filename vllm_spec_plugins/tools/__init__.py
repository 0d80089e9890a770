"""Tools around the plugin, not loaded by vLLM: the default and test models (`models`), prompt
sets (`data`), drafter training (`drafters`), engine runs for the benchmark and the tests
(`runner`) and the load tool (`load`)."""

"""Engine adapters: what differs per inference engine (see `ember.runtime.adapter.EngineAdapter`)."""

"""What runs on the runtime: the OpenAI server (`server/`), the bench and its reports, the demo, the device check,
the join-gap measurement. The runtime's core (every other module of runtime/) never imports them
(tests/test_layers.py): the decode loop, target, drafters and budget stand without any app."""

"""The server: three processes behind ``radixrt launch``.

- ``tokenizer_manager``: the front (ZeroMQ ROUTER for clients);
- ``scheduler_process``: the Scheduler loop behind sockets;
- ``detokenizer``: incremental decode into text deltas;
- ``launcher``: starts them (spawn), waits for ready, tears them down.
"""

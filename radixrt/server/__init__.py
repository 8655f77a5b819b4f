"""The server: the processes behind ``radixrt launch``.

- ``launcher``: starts the children (spawn, one ``spawn_args`` dataclass
  each), waits for ready, supervises, drains, restarts replicas, stops;
- ``scheduler_process``: one per data-parallel replica, the Scheduler loop
  behind sockets;
- ``detokenizer``: incremental decode into text deltas;
- ``tokenizer_manager``: the front, built from small roles: ``rpc`` (the
  ZeroMQ ROUTER), ``http`` (OpenAI and SGLang endpoints, through the
  ``front_api.FrontApi`` interface), ``front`` (the operations both share),
  ``admission``, ``request_table``, ``replicas`` (with ``routing``),
  ``responses``, ``controls``, ``drain`` and ``metrics``.

``common`` holds what every child shares (start-up, orphan checks, sockets);
``faults`` the test-only fault injection.
"""

"""The snapshot path of a rank: flatten the state (``state``, ``sharding``), choose a slot (``slot_choice``), copy
into it while training goes on (``stager``) and commit it in shared memory (``slots``)."""

"""Labs 04 and 05: the Triton server process, model repositories, clients, load generation and the lab's steps."""

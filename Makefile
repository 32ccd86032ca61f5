# The two commands of the README. Each does all set-up on a fresh machine first.
.PHONY: demo test bench image

demo:
	./scripts/demo

test:
	./scripts/test

bench:
	./scripts/bootstrap && .venv/bin/python bench/throughput.py && .venv/bin/python bench/recovery.py && .venv/bin/python bench/master_capacity.py && .venv/bin/python bench/chaos.py && .venv/bin/python bench/durability.py && .venv/bin/python bench/ps_strategy.py

# The runtime image as an OCI image layout (scripts/build-image; GPU=1: the GPU variant). Its last line is the
# layout's path: push it with `skopeo copy oci:<path>:<tag> docker://<registry>/<name>:<tag>`.
image:
	@./scripts/bootstrap && ./scripts/build-image $(if $(GPU),--gpu)

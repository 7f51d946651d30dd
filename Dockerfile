# Multi-stage build: the binary built on a Rust image, run on a distroless, non-root base.
#   docker build -t prism-operator:0.1.0 .
# Both bases are build arguments, so the same file builds where no registry is reachable:
#   docker build --build-arg BUILD_IMAGE=<local rust image> \
#                --build-arg RUNTIME_IMAGE=<local glibc + CA certificates base> .
# (scripts/e2e makes such bases from Debian packages; see docs/src/development/e2e.md).
# The runtime base needs glibc (libc, libm, libgcc_s) and runs the binary as 65532.
ARG BUILD_IMAGE=rust:1-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
# The dependencies first, in a layer of their own that only a change of the manifests
# or the lock file rebuilds: against empty stand-ins of the workspace's crates (and of
# the declared benches, which cargo wants to find), every dependency is compiled once
# and kept. A change to the sources then recompiles only the workspace's own crates.
COPY Cargo.toml Cargo.lock ./
COPY crates/prism-core/Cargo.toml crates/prism-core/
COPY crates/prism-kube/Cargo.toml crates/prism-kube/
COPY crates/prism-store/Cargo.toml crates/prism-store/build.rs crates/prism-store/
COPY crates/prism-api/Cargo.toml crates/prism-api/
COPY crates/prism-testkit/Cargo.toml crates/prism-testkit/
RUN for c in prism-core prism-kube prism-store prism-api prism-testkit; do \
         mkdir -p crates/$c/src && touch crates/$c/src/lib.rs; done \
    && mkdir -p src benches migrations \
    && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && for bench in $(grep -A1 '^\[\[bench\]\]' Cargo.toml | sed -n 's/^name = "\(.*\)"$/\1/p'); do \
         echo 'fn main() {}' > "benches/$bench.rs"; done \
    && cargo build --release --locked --bin prism-operator \
    && rm -rf src benches crates/*/src
COPY crates ./crates
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
COPY tests ./tests
# The sources keep their own modification times, which may be older than the
# stand-ins' build: touched, so cargo compiles them and not the stand-ins again. The
# binary goes out and this step's target changes go with it (kept in no layer).
RUN find src crates benches migrations -type f -exec touch {} + \
    && cargo build --release --locked --bin prism-operator \
    && install -D target/release/prism-operator /out/prism-operator && rm -rf target

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/prism-operator /usr/local/bin/prism-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/prism-operator"]
CMD ["run"]

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
COPY Cargo.toml Cargo.lock build.rs ./
COPY crates ./crates
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
COPY tests ./tests
# One step: the binary out, the target directory gone (it is ~1.5 GB, kept in no layer).
RUN cargo build --release --locked --bin prism-operator \
    && install -D target/release/prism-operator /out/prism-operator && rm -rf target

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/prism-operator /usr/local/bin/prism-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/prism-operator"]
CMD ["run"]

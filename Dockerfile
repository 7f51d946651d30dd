# Multi-stage build: a static-enough binary on a distroless, non-root base.
#   docker build -t prism-operator:0.1.0 .
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
COPY tests ./tests
RUN cargo build --release --locked --bin prism-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/prism-operator /usr/local/bin/prism-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/prism-operator"]
CMD ["run"]

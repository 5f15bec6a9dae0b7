# fenceproxy image: a cgo build (pg_query_go wraps PostgreSQL's parser) on
# Debian, copied into a slim Debian runtime.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=1 go build -trimpath -ldflags "-s -w" -o /out/fenceproxy ./cmd/fenceproxy

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 fenceproxy
COPY --from=build /out/fenceproxy /usr/local/bin/fenceproxy
USER fenceproxy
EXPOSE 6432 6438
ENTRYPOINT ["/usr/local/bin/fenceproxy"]
CMD ["serve", "-c", "/etc/fenceproxy/fenceproxy.yaml"]

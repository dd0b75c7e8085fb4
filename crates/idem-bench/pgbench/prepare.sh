# Sourced by run.sh, cpu.sh and wal.sh, from this folder: the database $url
# (IDEM_TEST_POSTGRES_URL, default postgres://postgres@127.0.0.1:5432/test)
# with setup.sql's tables, every script in the temporary folder $scripts
# (removed on exit, written by scripts.sh), and drop_tables, which drops
# setup.sql's tables again.
url=${IDEM_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
psql -q "$url" -f setup.sql
scripts=$(mktemp -d)
trap 'rm -rf "$scripts"' EXIT
bash scripts.sh "$scripts"

drop_tables() {
    psql -q "$url" -c "DROP TABLE IF EXISTS pgb_keys, pgb_keys_noexp, pgb_keys_brin, pgb_effects"
}

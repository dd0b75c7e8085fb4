//! Two ledger processes on one database — PostgreSQL, MariaDB, and one
//! SQLite file — with identical requests split across them: one effect, and
//! every answer the first one's (replayed) or 409.

mod common;

use common::{Engine, Instance, database_url, key, remove_database_files, token};

struct Answer {
    status: u16,
    replayed: bool,
    body: String,
}

async fn post(client: &reqwest::Client, base: &str, token: &str, key: &str, path: &str, body: &str) -> Answer {
    let r = client
        .post(format!("{base}{path}"))
        .header("authorization", format!("Bearer {token}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("the ledger answers");
    let status = r.status().as_u16();
    let replayed = r.headers().contains_key("idempotent-replayed");
    Answer {
        status,
        replayed,
        body: r.text().await.expect("a body"),
    }
}

/// What `GET url` answers the tenant of `token`, as JSON; `what` names it
/// if the ledger does not answer.
async fn get_json(client: &reqwest::Client, url: String, token: &str, what: &str) -> serde_json::Value {
    client
        .get(url)
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .expect(what)
        .json()
        .await
        .expect("json")
}

/// Sends `n` identical requests, alternating between the instances, all at
/// once; checks one first answer, every other one identical (replayed) or 409.
async fn split(client: &reqwest::Client, instances: &[Instance; 2], token: &str, path: &str, body: &str, n: usize) {
    let key = key();
    let answers = futures_util::future::join_all((0..n).map(|i| {
        let base = instances[i % 2].base.clone();
        let (client, key) = (client.clone(), key.clone());
        async move { post(&client, &base, token, &key, path, body).await }
    }))
    .await;
    let first: Vec<&Answer> = answers.iter().filter(|a| a.status == 201 && !a.replayed).collect();
    let replays = answers.iter().filter(|a| a.replayed).count();
    let in_flight = answers.iter().filter(|a| a.status == 409).count();
    eprintln!("{path}: {} ran, {replays} replayed, {in_flight} in flight", first.len());
    assert_eq!(first.len(), 1, "exactly one request ran {path}");
    for a in &answers {
        match a.status {
            201 => assert_eq!(a.body, first[0].body, "a replay is the first response"),
            409 => assert!(a.body.contains("idempotency-key-in-flight")),
            other => panic!("unexpected {other}: {}", a.body),
        }
    }
}

async fn two_instances_one_effect(engine: Engine) {
    let url = database_url(engine);
    let instances = [Instance::start(&url), Instance::start(&url)];
    let client = idem_tls::test_pki::http_client();
    let t = token();
    let mut accounts = Vec::new();
    for (i, name) in ["a", "b"].into_iter().enumerate() {
        let r = post(
            &client,
            &instances[i].base,
            &t,
            &key(),
            "/v1/accounts",
            &format!("{{\"name\":\"{name}\"}}"),
        )
        .await;
        assert_eq!(r.status, 201, "{}", r.body);
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("json");
        accounts.push(v["id"].as_str().expect("id").to_owned());
    }
    let (a, b) = (&accounts[0], &accounts[1]);
    split(
        &client,
        &instances,
        &t,
        "/v1/top-ups",
        &format!("{{\"account_id\":\"{a}\",\"amount\":100}}"),
        20,
    )
    .await;
    split(
        &client,
        &instances,
        &t,
        "/v1/transfers",
        &format!("{{\"from\":\"{a}\",\"to\":\"{b}\",\"amount\":30}}"),
        20,
    )
    .await;
    for (i, instance) in instances.iter().enumerate() {
        let audit = get_json(&client, format!("{}/v1/audit", instance.base), &t, "audit").await;
        assert_eq!(audit["top_ups_total"], 100, "instance {i}: one top-up applied");
        assert_eq!(audit["balances_total"], 100, "instance {i}");
        assert_eq!(audit["conserved"], true, "instance {i}");
        let balance = |id: &str| {
            let (client, base, t, id) = (client.clone(), instance.base.clone(), t.clone(), id.to_owned());
            async move {
                let v = get_json(&client, format!("{base}/v1/accounts/{id}"), &t, "account").await;
                v["balance"].as_i64().expect("balance")
            }
        };
        assert_eq!(
            (balance(a).await, balance(b).await),
            (70, 30),
            "instance {i}: one transfer applied"
        );
    }
    drop(instances);
    remove_database_files(engine, &url);
}

idem_conformance::cases!(two_instances_one_effect, 4 => {
    two_instances_on_postgres(Engine::Postgres);
    two_instances_on_mariadb(Engine::Mysql);
    two_instances_on_one_sqlite_file(Engine::Sqlite);
});

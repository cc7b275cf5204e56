#include "state_store/session_state.h"

#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "state_store/state_codec.h"

namespace sdm {
namespace {

LayerStateLayout SdmLayout(std::shared_ptr<const float> m0,
                           std::shared_ptr<RowPool> pool = std::make_shared<RowPool>(4)) {
  LayerStateLayout l;
  l.kind = LayerStateLayout::Kind::kSdm;
  l.sdm_heads = 2;
  l.slots_per_head = 16;
  l.row_width = 4;
  l.m0 = std::move(m0);
  l.row_pool = std::move(pool);
  return l;
}

TEST(SdmTableTest, UnwrittenSlotsReadM0) {
  auto m0 = std::make_shared<float[]>(2 * 16 * 4);
  for (int i = 0; i < 2 * 16 * 4; ++i) m0[i] = static_cast<float>(i);
  SdmTable t(SdmLayout(std::shared_ptr<const float>(m0, m0.get())));
  EXPECT_EQ(t.Row(1, 3)[2], static_cast<float>((16 + 3) * 4 + 2));
  EXPECT_EQ(t.private_rows(), 0);
  EXPECT_FALSE(t.IsPrivate(1, 3));
}

TEST(SdmTableTest, CopyOnWriteCountsDistinctSlots) {
  auto m0 = std::make_shared<float[]>(2 * 16 * 4);
  for (int i = 0; i < 2 * 16 * 4; ++i) m0[i] = 1.0f;
  SdmTable t(SdmLayout(std::shared_ptr<const float>(m0, m0.get())));
  std::map<std::pair<int, int>, float> written;  // slot -> expected value
  const int writes[][2] = {{0, 1}, {0, 5}, {1, 1}, {0, 1}, {1, 15}, {0, 5}};
  for (auto [h, s] : writes) {
    float* row = t.MutableRow(h, s);
    auto it = written.find({h, s});
    EXPECT_EQ(row[0], it == written.end() ? 1.0f : it->second);  // first write copies M0
    row[0] += 1.0f;
    written[{h, s}] = row[0];
  }
  EXPECT_EQ(t.private_rows(), static_cast<int64_t>(written.size()));
  // The shared M0 is never modified; the private row keeps its update.
  EXPECT_EQ(m0[0 * 16 * 4 + 1 * 4], 1.0f);
  EXPECT_GT(t.Row(0, 1)[0], 1.0f);
  EXPECT_EQ(t.Row(0, 2)[0], 1.0f);
}

TEST(SdmTableTest, NullM0ReadsZeros) {
  SdmTable t(SdmLayout(nullptr));
  EXPECT_EQ(t.Row(0, 0)[3], 0.0f);
  float* row = t.MutableRow(1, 7);
  EXPECT_EQ(row[1], 0.0f);
  row[1] = 2.0f;
  EXPECT_EQ(t.Row(1, 7)[1], 2.0f);
  EXPECT_EQ(t.Row(1, 6)[1], 0.0f);
}

TEST(SdmTableTest, ForkSharesRowsUntilWritten) {
  auto pool = std::make_shared<RowPool>(4);
  SdmTable a(SdmLayout(nullptr, pool));
  for (int s = 0; s < 5; ++s) a.MutableRow(0, s)[0] = static_cast<float>(s + 1);
  EXPECT_EQ(pool->live_rows(), 5);
  SdmTable b = a.Fork();
  EXPECT_EQ(pool->live_rows(), 5);  // nothing copied
  EXPECT_EQ(a.SharedRows(), 5);
  EXPECT_EQ(b.SharedRows(), 5);
  EXPECT_EQ(b.Row(0, 3), a.Row(0, 3));  // the same memory
  b.MutableRow(0, 3)[0] = 100.0f;       // copy-on-write: one row copied
  EXPECT_EQ(pool->live_rows(), 6);
  EXPECT_EQ(a.Row(0, 3)[0], 4.0f);
  EXPECT_EQ(b.Row(0, 3)[0], 100.0f);
  EXPECT_EQ(a.SharedRows(), 4);
  a.MutableRow(0, 0)[0] = -1.0f;  // the other side copies too
  EXPECT_EQ(pool->live_rows(), 7);
  EXPECT_EQ(b.Row(0, 0)[0], 1.0f);
  b.MutableRow(1, 9)[0] = 7.0f;  // a fresh slot in the fork only
  EXPECT_FALSE(a.IsPrivate(1, 9));
  EXPECT_EQ(b.private_rows(), 6);
  const int64_t shared_before = b.SharedRows();
  const int64_t live_before = pool->live_rows();
  {
    SdmTable c = b.Clone();  // deep: owns a copy of every row
    EXPECT_EQ(c.SharedRows(), 0);
    EXPECT_EQ(b.SharedRows(), shared_before);
    EXPECT_EQ(pool->live_rows(), live_before + c.private_rows());
    EXPECT_EQ(c.Row(0, 3)[0], 100.0f);
  }
  EXPECT_EQ(pool->live_rows(), live_before);
}

TEST(SdmTableTest, ReleasingTablesReturnsRows) {
  auto pool = std::make_shared<RowPool>(4);
  {
    SdmTable a(SdmLayout(nullptr, pool));
    for (int s = 0; s < 3; ++s) a.MutableRow(1, s);
    SdmTable b = a.Fork();
    EXPECT_EQ(pool->live_rows(), 3);
  }
  EXPECT_EQ(pool->live_rows(), 0);
}

// A stand-in write for the journal tests: row[c] = alpha * row[c] + k * (v[c] + beta + rule).
void AddWrite(std::span<float* const> rows, std::span<const float> k, std::span<const float> alpha,
              float beta, const float* v, int64_t width, uint32_t rule) {
  for (size_t i = 0; i < rows.size(); ++i) {
    const float a = alpha.size() == 1 ? alpha[0] : alpha[i];
    for (int64_t c = 0; c < width; ++c) {
      rows[i][c] = a * rows[i][c] + k[i] * (v[c] + beta + static_cast<float>(rule));
    }
  }
}

LayerStateLayout JournalLayout(bool record) {
  LayerStateLayout l = SdmLayout(nullptr);
  l.sdm_write.apply = &AddWrite;
  l.sdm_write.writes = 4;
  l.sdm_write.alphas = 1;
  l.sdm_write.rule = 3;
  l.sdm_write.record = record;
  return l;
}

// One journaled write of four slots, as the engine makes it: the rows first, then the record.
void JournaledWrite(SdmTable& t, int64_t head, std::array<int32_t, 4> slots, float value) {
  const float k[] = {0.5f, 0.25f, 2.0f, -1.0f}, alpha[] = {0.75f}, v[] = {value, 1, 2, 3};
  std::vector<float*> rows;
  for (int32_t s : slots) rows.push_back(t.MutableRow(head, s));
  AddWrite(rows, k, alpha, 0.125f, v, 4, 3);
  t.JournalWrite(head, slots, k, alpha, 0.125f, v);
}

TEST(SdmTableTest, AJournalReplayedOverTheCleanTableRebuildsItsRows) {
  SdmTable live(JournalLayout(true));
  JournaledWrite(live, 0, {1, 2, 3, 4}, 5.0f);
  live.ClearDirty();
  SdmTable replica = live.Clone();  // the state "on disk"
  EXPECT_TRUE(live.journal_complete());
  EXPECT_EQ(live.journal_records(), 0);
  JournaledWrite(live, 0, {2, 7, 8, 9}, 6.0f);  // slot 2 again: the order matters
  JournaledWrite(live, 1, {7, 0, 5, 6}, -1.0f);
  JournaledWrite(live, 0, {7, 2, 10, 11}, 2.0f);
  ASSERT_TRUE(live.journal_complete());
  EXPECT_EQ(live.journal_records(), 3);
  EXPECT_EQ(static_cast<int64_t>(live.journal().size()), 3 * live.JournalRecordBytes());
  EXPECT_EQ(live.JournalRecordBytes(), 4 + 8 * 4 + 4 + 4 + 4 * 4);
  ASSERT_TRUE(replica.ApplyJournal(live.journal(), live.journal_records()).ok());
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t s = 0; s < 16; ++s) {
      for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(replica.Row(h, s)[c], live.Row(h, s)[c]);
    }
  }
  EXPECT_EQ(replica.private_rows(), live.private_rows());
  // Damage the journal can name: a head or a slot outside the table, a count that does not fit.
  std::string bad(live.journal());
  bad[0] = 9;  // head 9
  EXPECT_EQ(replica.ApplyJournal(bad, 3).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(replica.ApplyJournal(live.journal(), 2).code(), absl::StatusCode::kDataLoss);
  bad = std::string(live.journal());
  const int32_t slot = 16;
  std::memcpy(bad.data() + 4, &slot, 4);
  EXPECT_EQ(replica.ApplyJournal(bad, 3).code(), absl::StatusCode::kDataLoss);
}

TEST(SdmTableTest, AJournalIsCompleteOnlyIfItHoldsEveryWrite) {
  SdmTable t(JournalLayout(true));
  EXPECT_TRUE(t.journal_complete());
  JournaledWrite(t, 0, {1, 2, 3, 4}, 1.0f);
  EXPECT_TRUE(t.journal_complete());
  t.MutableRow(1, 3)[0] = 4.0f;  // a write the journal does not hold
  EXPECT_FALSE(t.journal_complete());
  t.ClearDirty();
  EXPECT_TRUE(t.journal_complete());
  // A restored row is not a journaled write either.
  const std::vector<float> row = {1, 2, 3, 4};
  ASSERT_TRUE(t.RestoreRow(1, 9, row).ok());
  EXPECT_FALSE(t.journal_complete());
  t.ClearDirty();
  // Forks keep the spec and start with an empty journal.
  JournaledWrite(t, 0, {4, 5, 6, 7}, 1.0f);
  SdmTable fork = t.Fork();
  EXPECT_TRUE(fork.journal_complete());
  EXPECT_EQ(fork.journal_records(), 0);
  EXPECT_EQ(fork.write_spec().apply, &AddWrite);
  // Not recording, or no write function: never complete, nothing recorded.
  LayerStateLayout off_layout = JournalLayout(false);
  LayerStateLayout no_apply_layout = JournalLayout(true);
  no_apply_layout.sdm_write.apply = nullptr;
  SdmTable off(off_layout), no_apply(no_apply_layout);
  for (SdmTable* table : {&off, &no_apply}) {
    JournaledWrite(*table, 0, {1, 2, 3, 4}, 1.0f);
    EXPECT_FALSE(table->journal_complete());
    EXPECT_EQ(table->journal_records(), 0);
  }
  EXPECT_EQ(no_apply.ApplyJournal("", 0).code(), absl::StatusCode::kUnimplemented);
}

TEST(SdmTableTest, AJournalThatWouldOutgrowItsRowsIsDropped) {
  SdmTable t(JournalLayout(true));
  // A record is 60 bytes; the four rows it writes are 4 x 20 with their indices. Writing the
  // same slots again grows the journal, not the rows.
  JournaledWrite(t, 0, {1, 2, 3, 4}, 1.0f);
  EXPECT_TRUE(t.journal_complete());  // 60 <= 80
  JournaledWrite(t, 1, {1, 2, 3, 4}, 1.0f);
  EXPECT_TRUE(t.journal_complete());  // 120 <= 160
  EXPECT_EQ(t.journal_records(), 2);
  JournaledWrite(t, 1, {4, 3, 2, 1}, 1.0f);  // 180 > 160
  EXPECT_FALSE(t.journal_complete());
  EXPECT_EQ(t.journal().size(), 0u);
  EXPECT_EQ(t.journal_records(), 0);
  JournaledWrite(t, 0, {5, 6, 7, 8}, 1.0f);  // dropped until the next ClearDirty
  EXPECT_FALSE(t.journal_complete());
  t.ClearDirty();
  JournaledWrite(t, 0, {1, 2, 3, 4}, 1.0f);
  EXPECT_TRUE(t.journal_complete());
  EXPECT_EQ(t.journal_records(), 1);
}

TEST(KvCacheTest, FullCacheKeepsEveryPosition) {
  KvCache c(3, 0);
  for (int p = 0; p < 600; ++p) {
    float* k = c.NextKeyRow();
    float* v = c.NextValueRow();
    for (int i = 0; i < 3; ++i) k[i] = p, v[i] = -p;
    c.Commit();
  }
  EXPECT_EQ(c.length(), 600);
  EXPECT_EQ(c.first_position(), 0);
  EXPECT_EQ(c.KeyRow(0)[1], 0.0f);
  EXPECT_EQ(c.KeyRow(599)[2], 599.0f);
  EXPECT_EQ(c.ValueRow(300)[0], -300.0f);
  // Spans are contiguous runs that never cross a page.
  int64_t next = 10;
  c.ForEachSpan(10, 600, [&](int64_t p, int64_t n, const float* k, const float* v) {
    EXPECT_EQ(p, next);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(k[i * 3], static_cast<float>(p + i));
    next = p + n;
  });
  EXPECT_EQ(next, 600);
}

TEST(KvCacheTest, RingKeepsTheLastPositions) {
  KvCache c(1, 5);
  for (int p = 0; p < 12; ++p) {
    *c.NextKeyRow() = p;
    *c.NextValueRow() = p;
    c.Commit();
  }
  EXPECT_EQ(c.first_position(), 7);
  std::vector<float> seen;
  c.ForEachSpan(7, 12, [&](int64_t p, int64_t n, const float* k, const float*) {
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(k[i], static_cast<float>(p + i));
      seen.push_back(k[i]);
    }
  });
  EXPECT_EQ(seen, (std::vector<float>{7, 8, 9, 10, 11}));
}

// A bf16 cache: rows rounded on the way in, half the bytes, widened exactly on the way out; a
// snapshot holds fp32 rows, so it restores into a bf16 or an fp32 cache alike.
TEST(KvCacheTest, Bf16RowsRoundAndHalveTheBytes) {
  const int64_t width = 5;
  KvCache c16(width, 0, DType::kBf16), c32(width, 0);
  EXPECT_EQ(c16.element(), DType::kBf16);
  std::vector<float> k(width), v(width);
  for (int p = 0; p < 300; ++p) {
    for (int i = 0; i < width; ++i) k[i] = 1.0f + p / 1024.0f + i, v[i] = -k[i] / 3.0f;
    c16.AppendRow(k.data(), v.data());
    c32.AppendRow(k.data(), v.data());
  }
  EXPECT_EQ(c16.length(), 300);
  EXPECT_EQ(2 * c16.ResidentBytes(), c32.ResidentBytes());
  int64_t rounded = 0;
  for (int p = 0; p < 300; ++p) {
    for (int i = 0; i < width; ++i) {
      ASSERT_EQ(Bf16ToFloat(c16.KeyRow<uint16_t>(p)[i]), RoundToBf16(c32.KeyRow(p)[i]));
      ASSERT_EQ(Bf16ToFloat(c16.ValueRow<uint16_t>(p)[i]), RoundToBf16(c32.ValueRow(p)[i]));
      rounded += RoundToBf16(c32.KeyRow(p)[i]) != c32.KeyRow(p)[i];
    }
  }
  EXPECT_GT(rounded, 0);  // the values need more than bf16's 8 bits
  // ForEachSpanAsFloat widens in runs; Clone copies the bits.
  const KvCache copy = c16.Clone();
  int64_t next = 3;
  c16.ForEachSpanAsFloat(3, 300, /*value=*/true, [&](const float* rows, int64_t n) {
    for (int64_t r = 0; r < n; ++r) {
      for (int i = 0; i < width; ++i) {
        ASSERT_EQ(rows[r * width + i], Bf16ToFloat(copy.ValueRow<uint16_t>(next + r)[i]));
      }
    }
    next += n;
  });
  EXPECT_EQ(next, 300);
  // The typed accessors check the element type.
  EXPECT_DEATH(c16.KeyRow<float>(0), "wrong element type");
}

TEST(KvCacheTest, Bf16SnapshotsHoldFp32AndRestoreIntoEitherType) {
  auto layout = [](DType t) {
    StateLayout l;
    LayerStateLayout kv;
    kv.kind = LayerStateLayout::Kind::kKv;
    kv.kv_row_width = 4;
    kv.ring_capacity = 7;  // a sliding-window ring that has wrapped
    kv.kv_element = t;
    l.layers.push_back(kv);
    return l;
  };
  SessionState s(layout(DType::kBf16));
  std::vector<float> k(4), v(4);
  for (int p = 0; p < 20; ++p) {
    for (int i = 0; i < 4; ++i) k[i] = 0.1f * p + i, v[i] = -0.3f * p;
    s.kv(0).AppendRow(k.data(), v.data());
    s.AdvancePosition();
  }
  const std::string blob = EncodeSessionState(s, SessionRecord{"x", ""}, 9);
  for (DType t : {DType::kBf16, DType::kF32}) {
    auto d = DecodeSessionState(blob, layout(t), 9);
    ASSERT_TRUE(d.ok()) << d.status();
    const KvCache& got = d->state->kv(0);
    ASSERT_EQ(got.length(), 20);
    for (int64_t p = got.first_position(); p < 20; ++p) {
      for (int i = 0; i < 4; ++i) {
        const float want = Bf16ToFloat(s.kv(0).KeyRow<uint16_t>(p)[i]);
        ASSERT_EQ(t == DType::kBf16 ? Bf16ToFloat(got.KeyRow<uint16_t>(p)[i]) : got.KeyRow(p)[i],
                  want);
      }
    }
  }
}

TEST(SessionStateTest, BuildsOneStatePerLayer) {
  StateLayout layout;
  LayerStateLayout kv;
  kv.kind = LayerStateLayout::Kind::kKv;
  kv.kv_row_width = 8;
  layout.layers.push_back(kv);
  layout.layers.push_back(SdmLayout(nullptr));
  SessionState s(layout);
  EXPECT_EQ(s.num_layers(), 2);
  EXPECT_EQ(s.kv(0).row_width(), 8);
  EXPECT_EQ(s.sdm(1).heads(), 2);
  const int64_t before = s.ResidentBytes();
  s.sdm(1).MutableRow(0, 0);
  EXPECT_GT(s.ResidentBytes(), before);
  EXPECT_EQ(s.position(), 0);
  s.AdvancePosition();
  EXPECT_EQ(s.position(), 1);
}

}  // namespace
}  // namespace sdm

#include "kernels/cpu/sdm_update.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/sdm_addressing.h"

namespace sdm::kernels::cpu {
namespace {

using Table = std::vector<std::vector<float>>;

std::vector<float*> RowPtrs(Table& t, const std::vector<int32_t>& idx) {
  std::vector<float*> p;
  for (int32_t i : idx) p.push_back(t[i].data());
  return p;
}

std::vector<const float*> ConstRowPtrs(const Table& t, const std::vector<int32_t>& idx) {
  std::vector<const float*> p;
  for (int32_t i : idx) p.push_back(t[i].data());
  return p;
}

TEST(SdmUpdateTest, TwoSlotExampleSharedResidual) {
  // docs/model-spec.md §5.4: alpha=0.8, beta=0.5, M=[2.5, 5], k=[0.5, 0.5], v=10 -> [3.75, 5.75].
  Table m = {{2.5f}, {5.0f}};
  const float v = 10.0f;
  std::vector<float> k = {0.5f, 0.5f}, alpha = {0.8f};
  SdmWriteColumns(RowPtrs(m, {0, 1}), k, alpha, 0.5f, &v, SdmRule::kSharedResidual, 0, 1);
  EXPECT_FLOAT_EQ(m[0][0], 3.75f);
  EXPECT_FLOAT_EQ(m[1][0], 5.75f);
}

TEST(SdmUpdateTest, TwoSlotExampleSlotResidual) {
  // The paper's printed Eq. 4 gives [4, 5.5] on the same example.
  Table m = {{2.5f}, {5.0f}};
  const float v = 10.0f;
  std::vector<float> k = {0.5f, 0.5f}, alpha = {0.8f};
  SdmWriteColumns(RowPtrs(m, {0, 1}), k, alpha, 0.5f, &v, SdmRule::kSlotResidual, 0, 1);
  EXPECT_FLOAT_EQ(m[0][0], 4.0f);
  EXPECT_FLOAT_EQ(m[1][0], 5.5f);
}

// A port of the reference's token-by-token oracle (tests/test_autograd_reference.py,
// sdm_reference): gather the written rows, decay them, predict, and scatter-add the difference
// into the whole table, in double precision.
struct OracleStep {
  std::vector<int32_t> k_idx, q_idx;
  std::vector<double> k_val, q_val, g;  // g: one value, or one per write (key-weighted decay)
  std::vector<double> v;
  double beta;
};

std::vector<std::vector<double>> RunOracle(std::vector<std::vector<double>>& mem,
                                           const std::vector<OracleStep>& steps) {
  const size_t dim = mem[0].size();
  std::vector<std::vector<double>> readings;
  for (const OracleStep& s : steps) {
    const size_t w = s.k_idx.size();
    std::vector<std::vector<double>> mem_read(w, std::vector<double>(dim));
    std::vector<double> retrieved(dim, 0.0);
    for (size_t i = 0; i < w; ++i) {
      const double decay = std::exp(s.g.size() == 1 ? s.g[0] : s.g[i]);
      for (size_t c = 0; c < dim; ++c) {
        mem_read[i][c] = mem[s.k_idx[i]][c] * decay;
        retrieved[c] += s.k_val[i] * mem_read[i][c];
      }
    }
    std::vector<std::vector<double>> update(mem.size(), std::vector<double>(dim, 0.0));
    for (size_t i = 0; i < w; ++i) {
      for (size_t c = 0; c < dim; ++c) {
        const double delta_v = s.beta * (s.v[c] - retrieved[c]);
        update[s.k_idx[i]][c] += mem_read[i][c] - mem[s.k_idx[i]][c] + s.k_val[i] * delta_v;
      }
    }
    for (size_t r = 0; r < mem.size(); ++r) {
      for (size_t c = 0; c < dim; ++c) mem[r][c] += update[r][c];
    }
    std::vector<double> y(dim, 0.0);
    for (size_t j = 0; j < s.q_idx.size(); ++j) {
      for (size_t c = 0; c < dim; ++c) y[c] += s.q_val[j] * mem[s.q_idx[j]][c];
    }
    readings.push_back(y);
  }
  return readings;
}

std::vector<int32_t> SortedDistinct(std::mt19937& rng, int n, int k) {
  std::vector<int32_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(k);
  std::sort(all.begin(), all.end());
  return all;
}

void CheckAgainstOracle(bool key_weighted, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  const int slots = 64, dim = 200, writes = 6, reads = 9, steps = 12;
  std::vector<std::vector<double>> mem(slots, std::vector<double>(dim));
  for (auto& row : mem) {
    for (double& x : row) x = 0.1 * normal(rng);
  }
  Table table(slots, std::vector<float>(dim));
  for (int r = 0; r < slots; ++r) {
    for (int c = 0; c < dim; ++c) {
      table[r][c] = static_cast<float>(mem[r][c]);
      mem[r][c] = table[r][c];  // both start from the same fp32 values
    }
  }
  std::vector<OracleStep> plan;
  for (int t = 0; t < steps; ++t) {
    OracleStep s;
    s.k_idx = SortedDistinct(rng, slots, writes);
    s.q_idx = SortedDistinct(rng, slots, reads);
    for (int i = 0; i < writes; ++i) s.k_val.push_back(static_cast<float>(0.3 * normal(rng)));
    for (int j = 0; j < reads; ++j) s.q_val.push_back(static_cast<float>(0.3 * normal(rng)));
    for (int c = 0; c < dim; ++c) s.v.push_back(static_cast<float>(0.1 * normal(rng)));
    s.beta = static_cast<float>(0.3 * unif(rng));
    const double g = static_cast<float>(-0.01 - 0.49 * unif(rng));
    if (key_weighted) {
      for (int i = 0; i < writes; ++i) s.g.push_back(static_cast<float>(g * s.k_val[i]));
    } else {
      s.g.push_back(g);
    }
    plan.push_back(s);
  }
  auto want = RunOracle(mem, plan);
  for (int t = 0; t < steps; ++t) {
    const OracleStep& s = plan[t];
    auto to_f = [](const std::vector<double>& d) { return std::vector<float>(d.begin(), d.end()); };
    std::vector<float> k = to_f(s.k_val), q = to_f(s.q_val), v = to_f(s.v), alpha;
    for (double g : s.g) alpha.push_back(static_cast<float>(std::exp(g)));
    std::vector<float> y(dim);
    // Uneven column tiles: tiling must not change the result.
    const int cuts[] = {0, 37, 64, 150, dim};
    for (int i = 0; i + 1 < 5; ++i) {
      SdmWriteColumns(RowPtrs(table, s.k_idx), k, alpha, static_cast<float>(s.beta), v.data(),
                      SdmRule::kSharedResidual, cuts[i], cuts[i + 1]);
      SdmReadColumns(ConstRowPtrs(table, s.q_idx), q, y.data(), cuts[i], cuts[i + 1]);
    }
    for (int c = 0; c < dim; ++c) ASSERT_NEAR(y[c], want[t][c], 1e-5) << "step " << t;
  }
  for (int r = 0; r < slots; ++r) {
    for (int c = 0; c < dim; ++c) ASSERT_NEAR(table[r][c], mem[r][c], 1e-5);
  }
}

TEST(SdmUpdateTest, MatchesReferenceOracle) { CheckAgainstOracle(false, 7); }
TEST(SdmUpdateTest, MatchesReferenceOracleKeyWeightedDecay) { CheckAgainstOracle(true, 8); }

TEST(SdmUpdateTest, FreshSeedsMatchReferenceOracle) {
  std::random_device rd;
  const uint32_t seed = rd();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  CheckAgainstOracle(seed % 2 == 0, seed);
}

// With K = s^2 every slot is selected and SDM is the dense gated delta rule whose key is the
// softmax weight vector k:  S <- alpha S + beta k (v - alpha S^T k)^T,  y = S^T q.
TEST(SdmUpdateTest, FullAddressingEqualsDenseGatedDeltaRule) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  const int64_t side = 4, n = side * side, dim = 24, steps = 10;
  Table table(n, std::vector<float>(dim));
  std::vector<std::vector<double>> dense(n, std::vector<double>(dim));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < dim; ++c) dense[r][c] = table[r][c] = 0.2f * normal(rng);
  }
  AddressScratch scratch;
  for (int t = 0; t < steps; ++t) {
    std::vector<float> wscore(2 * side), rscore(2 * side), v(dim);
    for (float& x : wscore) x = normal(rng);
    for (float& x : rscore) x = normal(rng);
    for (float& x : v) x = normal(rng);
    const float alpha = 0.9f, beta = 0.6f;
    std::vector<int32_t> ws(n), rs(n);
    std::vector<float> wk(n), rq(n);
    SelectSlots(wscore.data(), side, n, ws, wk, scratch);
    SelectSlots(rscore.data(), side, n, rs, rq, scratch);
    ActivateAddress(AddressAct::kSoftmax, 1.0f, wk);
    ActivateAddress(AddressAct::kSoftmax, 1.0f, rq);
    ASSERT_EQ(ws[n - 1], n - 1);  // every slot, in order
    std::vector<float> y(dim);
    std::vector<float> a = {alpha};
    SdmWriteColumns(RowPtrs(table, ws), wk, a, beta, v.data(), SdmRule::kSharedResidual, 0, dim);
    SdmReadColumns(ConstRowPtrs(table, rs), rq, y.data(), 0, dim);
    // Dense: pred = alpha S^T k; S = alpha S + beta k (v - pred)^T.
    for (int64_t c = 0; c < dim; ++c) {
      double pred = 0;
      for (int64_t i = 0; i < n; ++i) pred += alpha * dense[i][c] * wk[i];
      for (int64_t i = 0; i < n; ++i) {
        dense[i][c] = alpha * dense[i][c] + beta * wk[i] * (v[c] - pred);
      }
      double yc = 0;
      for (int64_t i = 0; i < n; ++i) yc += dense[i][c] * rq[i];
      ASSERT_NEAR(y[c], yc, 1e-5) << "step " << t << " col " << c;
    }
  }
}

// SdmWriteRows (what replaying a journaled write runs) computes every column as the engine's
// tiling by kSdmWriteColumnTile does, bit for bit, for both rules, one or per-row decays, and
// widths that are and are not multiples of the tile; and so does any tiling by a multiple of the
// write's internal tile (one call over the whole row, tiles of 64): what the header promises, and
// what lets the replay ignore how the engine split a row across threads.
TEST(SdmUpdateTest, WriteRowsIsTheEnginesTiledWriteBitForBit) {
  const uint32_t fresh = std::random_device{}();
  for (uint32_t seed : {1u, 2u, fresh}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (int64_t width : {int64_t{32}, int64_t{128}, int64_t{300}, int64_t{1024}}) {
      for (SdmRule rule : {SdmRule::kSharedResidual, SdmRule::kSlotResidual}) {
        for (bool per_row : {false, true}) {
          const int n = 5;
          Table a(n, std::vector<float>(width));
          for (auto& row : a) {
            for (float& x : row) x = normal(rng);
          }
          Table b = a, whole = a, by64 = a;
          std::vector<float> k(n), alpha(per_row ? n : 1), v(width);
          for (float& x : k) x = normal(rng);
          for (float& x : alpha) x = std::exp(-std::abs(normal(rng)));
          for (float& x : v) x = normal(rng);
          const float beta = 0.3f + 0.1f * std::abs(normal(rng));
          const std::vector<int32_t> idx = {0, 1, 2, 3, 4};
          for (int64_t c0 = 0; c0 < width; c0 += kSdmWriteColumnTile) {
            SdmWriteColumns(RowPtrs(a, idx), k, alpha, beta, v.data(), rule, c0,
                            std::min(width, c0 + kSdmWriteColumnTile));
          }
          SdmWriteRows(RowPtrs(b, idx), k, alpha, beta, v.data(), width,
                       static_cast<uint32_t>(rule));
          SdmWriteColumns(RowPtrs(whole, idx), k, alpha, beta, v.data(), rule, 0, width);
          for (int64_t c0 = 0; c0 < width; c0 += 64) {
            SdmWriteColumns(RowPtrs(by64, idx), k, alpha, beta, v.data(), rule, c0,
                            std::min(width, c0 + 64));
          }
          for (int i = 0; i < n; ++i) {
            ASSERT_EQ(0, std::memcmp(a[i].data(), b[i].data(), width * sizeof(float)))
                << "width " << width << " row " << i;
            ASSERT_EQ(0, std::memcmp(a[i].data(), whole[i].data(), width * sizeof(float)))
                << "width " << width << " row " << i << ", one call";
            ASSERT_EQ(0, std::memcmp(a[i].data(), by64[i].data(), width * sizeof(float)))
                << "width " << width << " row " << i << ", tiles of 64";
          }
        }
      }
    }
  }
}

TEST(SdmUpdateTest, ReadAfterWriteSeesTheUpdate) {
  Table m = {{1.0f, 2.0f}};
  std::vector<float> v = {5.0f, 5.0f}, k = {1.0f}, alpha = {1.0f}, q = {1.0f}, y(2);
  SdmWriteColumns(RowPtrs(m, {0}), k, alpha, 1.0f, v.data(), SdmRule::kSharedResidual, 0, 2);
  SdmReadColumns(ConstRowPtrs(m, {0}), q, y.data(), 0, 2);
  // beta = k = alpha = 1 overwrites the row with v.
  EXPECT_FLOAT_EQ(y[0], 5.0f);
  EXPECT_FLOAT_EQ(y[1], 5.0f);
}

}  // namespace
}  // namespace sdm::kernels::cpu

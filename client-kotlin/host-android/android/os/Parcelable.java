// Host stand-in for android.os.Parcelable (JVM tests only).
package android.os;

public interface Parcelable {
    int PARCELABLE_WRITE_RETURN_VALUE = 1;
    int describeContents();
    void writeToParcel(Parcel dest, int flags);
    interface Creator<T> {
        T createFromParcel(Parcel source);
        T[] newArray(int size);
    }
}
